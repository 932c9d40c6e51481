"""scripts/planner_vs_steps.py reads a committed results file and its
profile and prints the planner's verdict beside every measured step."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "docs" / "results" / "h200-sustained-paced-2026-12-03.json"
PROFILE = REPO / "docs" / "profiles" / "h200-qwen2.5-vl-3b-2026-12-03-session15.json"
VERDICTS = {"passes", "encoder", "generator", "tpot", "ttft", "max_num_seqs"}


def test_every_measured_step_gets_the_models_verdict():
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "planner_vs_steps.py"), str(RESULTS), str(PROFILE)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rows = done.stdout.splitlines()[1:]
    steps = json.loads(RESULTS.read_text())["steps"]
    measured = [(layout, key, step) for layout, works in steps.items() for key, items in works.items()
                for step in items]
    assert len(rows) == len(measured) == 24
    for row in rows:
        assert row.split()[-1] in VERDICTS, row
    # Each row names its layout, workload and rate as measured.
    first = next(s for layout, key, s in measured if (layout, key) == ("aggregated", "4img-400tok"))
    assert any(row.startswith("aggregated  4img-400tok") and f"{first['request_rate']:5.2f}" in row for row in rows)
