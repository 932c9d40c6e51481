"""The planner's analysis scripts (scripts/planner_vs_steps.py,
scripts/planner_timeshare_model.py) on the committed H200 results and the
profile those were measured with."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from planner_helpers import IMAGE_TOKENS, make_profile
from pipeline.planner.profile import Profile, vision_batch_s

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "docs" / "results" / "h200-sustained-paced-2026-12-03.json"
PROFILE = REPO / "docs" / "profiles" / "h200-qwen2.5-vl-3b-2026-12-03-session15.json"
VERDICTS = {"passes", "encoder", "generator", "tpot", "ttft", "max_num_seqs"}


def run_script(name: str) -> list[str]:
    done = subprocess.run([sys.executable, str(REPO / "scripts" / name), str(RESULTS), str(PROFILE)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()[1:]


def measured_steps() -> list[tuple[str, str, dict]]:
    steps = json.loads(RESULTS.read_text())["steps"]
    return [(layout, key, step) for layout, works in steps.items() for key, items in works.items() for step in items]


def test_every_measured_step_gets_the_models_verdict():
    rows = run_script("planner_vs_steps.py")
    measured = measured_steps()
    assert len(rows) == len(measured) == 24
    for row in rows:
        assert row.split()[-1] in VERDICTS, row
    # Each row names its layout, workload and rate as measured.
    first = next(s for layout, key, s in measured if (layout, key) == ("aggregated", "4img-400tok"))
    assert any(row.startswith("aggregated  4img-400tok") and f"{first['request_rate']:5.2f}" in row for row in rows)


def load_timeshare():
    spec = importlib.util.spec_from_file_location("planner_timeshare_model",
                                                  REPO / "scripts" / "planner_timeshare_model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_candidate_model_is_set_beside_each_measured_maximum():
    rows = run_script("planner_timeshare_model.py")
    model = load_timeshare()
    steps = json.loads(RESULTS.read_text())["steps"]
    expected = {(layout, key): model.sustained(items) for layout, works in steps.items() for key, items in works.items()}
    assert len(rows) == len(expected) == 8
    for row in rows:
        layout, key, measured = row.split()[:3]
        assert float(measured) == pytest.approx(expected[(layout, key)], abs=0.005), row
    # The session-15 figures docs/benchmarks.md quotes: aggregated 14.03, EPD 16.00 at 4 images, 400 tokens.
    assert expected[("aggregated", "4img-400tok")] == pytest.approx(14.03, abs=0.01)
    assert expected[("epd", "4img-400tok")] == pytest.approx(16.00, abs=0.01)


def test_graph_pieces_add_the_power_of_two_forwards():
    """With a fixed cost a forward, T(b) = 0.01 + 0.01*b: 3 images run as a
    2-image and a 1-image forward, T(2) + T(1) = 0.05 s (one forward of 3
    would take 0.04); 2.5 images blend 2 (0.03) and 3 (0.05)."""
    model = load_timeshare()
    data = msgspec.to_builtins(make_profile())
    for point in data["vision"]:
        point["alone_s"] = 0.01 + 0.01 * point["batch"]
    profile = msgspec.convert(data, Profile)
    assert vision_batch_s(profile, IMAGE_TOKENS, 3) == pytest.approx(0.04)
    assert model.pieces_s(profile, IMAGE_TOKENS, 3) == pytest.approx(0.05)
    assert model.pieces_s(profile, IMAGE_TOKENS, 2.5) == pytest.approx(0.04)
    assert model.sustained([{"passed": True, "request_rate": 2.0, "offered_rate": 2.0, "achieved_rate": 1.9},
                            {"passed": False, "request_rate": 3.0, "offered_rate": 3.0, "achieved_rate": 2.5}]) == 1.9
