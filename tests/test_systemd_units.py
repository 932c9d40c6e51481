"""The systemd units, in systemd/ and as `epd-launch --write-systemd` writes
them: systemd-analyze verify passes (the programs they start are swapped for
ones that exist here; with EPD_REQUIRE_SYSTEMD_ANALYZE=1, as .ci/run sets
where it is installed, the check fails rather than skips without it), every
service is Type=notify, watched and has a Restart= policy, the MPS unit stops
its daemon through epd-mps's SIGTERM, and the written config file is the box
the flags described."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from pipeline.launch import cli
from pipeline.launch.systemd_units import launcher_unit, mps_unit

UNITS = sorted((REPO / "systemd").glob("*.service"))
REQUIRE_ANALYZE = "EPD_REQUIRE_SYSTEMD_ANALYZE"


def settings(text: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        match = re.match(r"^(\w+)=(.*)$", line)
        if match:
            found.setdefault(match[1], []).append(match[2])
    return found


def test_every_unit_waits_for_ready_is_watched_and_restarts():
    assert {p.name for p in UNITS} == {"epd.service", "epd-mps.service"}
    for path in UNITS:
        unit = settings(path.read_text())
        assert unit["Type"] == ["notify"] and unit["NotifyAccess"] == ["main"], path.name
        assert int(unit["WatchdogSec"][0]) > 0 and unit["Restart"] == ["on-failure"], path.name
    assert "--config /etc/epd/epd.yaml" in settings((REPO / "systemd" / "epd.service").read_text())["ExecStart"][0]


def test_the_mps_unit_runs_epd_mps_whose_sigterm_alone_stops_the_daemon():
    unit = settings((REPO / "systemd" / "epd-mps.service").read_text())
    assert unit["ExecStart"] == ["/opt/epd/.venv/bin/epd-mps"] and "ExecStop" not in unit
    assert unit["KillMode"] == ["mixed"] and unit["KillSignal"] == ["SIGTERM"]
    assert int(unit["TimeoutStopSec"][0]) > 20   # epd-mps's --stop-timeout, then its SIGKILL
    assert unit["Environment"] == ["CUDA_MPS_PIPE_DIRECTORY=/run/epd-mps/pipe",
                                   "CUDA_MPS_LOG_DIRECTORY=/var/log/epd-mps"]


def test_the_repository_units_are_what_write_systemd_writes_for_the_defaults():
    assert (REPO / "systemd" / "epd.service").read_text() == launcher_unit(
        "/opt/epd/.venv/bin/epd-launch", Path("/etc/epd/epd.yaml"), mps=True)
    assert (REPO / "systemd" / "epd-mps.service").read_text() == mps_unit("/opt/epd/.venv/bin/epd-mps")


def written(tmp_path, *flags: str) -> Path:
    folder = tmp_path / "units"
    result = subprocess.run([sys.executable, str(REPO / "bin" / "epd-launch"), "--write-systemd", str(folder),
                             *flags], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "wrote epd.service" in result.stdout, result.stderr
    return folder


def test_write_systemd_writes_the_units_and_the_config_of_the_topology(tmp_path):
    folder = written(tmp_path, "--generators", "3", "--max-num-seqs", "16", "--served-model-name", "a", "b",
                     "--mps", "on")
    assert sorted(p.name for p in folder.iterdir()) == ["epd-mps.service", "epd.service", "epd.yaml"]
    unit = (folder / "epd.service").read_text()
    assert "Requires=epd-mps.service" in unit and "Type=notify" in unit
    args = cli.parse_args(["--config", str(folder / "epd.yaml")])      # the file is the box the flags said
    assert (args.generators, args.max_num_seqs, args.served_model_name) == (3, 16, ["a", "b"])
    assert args.mps == "on"
    alone = written(tmp_path / "cpu", "--device", "cpu")               # no GPU shared: no MPS unit
    assert sorted(p.name for p in alone.iterdir()) == ["epd.service", "epd.yaml"]
    assert "epd-mps" not in (alone / "epd.service").read_text()


def verify(folder: Path, names: list[str]) -> list[str]:
    """systemd-analyze verify's complaints about the units (its exit status
    is 0 even for a line it ignores), their programs swapped for /bin/true;
    copies keep their names, so one's Requires= finds the other."""
    checked = folder / "checked"
    checked.mkdir()
    for name in names:
        text = re.sub(r"^(Exec\w+=)(\S+)", r"\1/bin/true", (folder / name).read_text(), flags=re.M)
        (checked / name).write_text(text)
    result = subprocess.run(["systemd-analyze", "verify", *(f"./{name}" for name in names)], capture_output=True,
                            text=True, timeout=60, cwd=checked)
    return [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]


def test_systemd_analyze_verifies_the_units(tmp_path):
    if shutil.which("systemd-analyze") is None:
        if os.environ.get(REQUIRE_ANALYZE) == "1":
            pytest.fail(f"{REQUIRE_ANALYZE}=1 but systemd-analyze is not on PATH")
        pytest.skip("systemd-analyze is not installed")
    repo_copy = tmp_path / "repo"
    repo_copy.mkdir()
    for path in UNITS:
        shutil.copy(path, repo_copy / path.name)
    assert verify(repo_copy, [p.name for p in UNITS]) == []
    folder = written(tmp_path, "--generators", "2", "--mps", "on")
    assert re.search(r"^ExecStart=\S*(/epd-mps| -m pipeline\.launch\.mps_service)$",
                     (folder / "epd-mps.service").read_text(), flags=re.M)
    assert verify(folder, ["epd.service", "epd-mps.service"]) == []
