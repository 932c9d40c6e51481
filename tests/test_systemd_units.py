"""The systemd units, in systemd/ and as `epd-launch --write-systemd` writes
them: systemd-analyze verify passes (the programs they start are swapped for
ones that exist here), the launcher's unit is Type=notify and watched, every
service has a Restart= policy, and the written config file is the box the
flags described."""

from __future__ import annotations

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


def settings(text: str) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        match = re.match(r"^(\w+)=(.*)$", line)
        if match:
            found.setdefault(match[1], []).append(match[2])
    return found


def test_the_launcher_unit_waits_for_ready_and_is_watched():
    unit = settings((REPO / "systemd" / "epd.service").read_text())
    assert unit["Type"] == ["notify"] and unit["NotifyAccess"] == ["main"]
    assert int(unit["WatchdogSec"][0]) > 0 and unit["Restart"] == ["on-failure"]
    assert "--config /etc/epd/epd.yaml" in unit["ExecStart"][0]
    for path in UNITS:
        assert settings(path.read_text()).get("Restart"), f"{path.name} has no Restart= policy"


def test_the_repository_units_are_what_write_systemd_writes_for_the_defaults():
    assert (REPO / "systemd" / "epd.service").read_text() == launcher_unit(
        "/opt/epd/.venv/bin/epd-launch", Path("/etc/epd/epd.yaml"), mps=True)
    assert (REPO / "systemd" / "epd-mps.service").read_text() == mps_unit()


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


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verifies_the_units(tmp_path):
    repo_copy = tmp_path / "repo"
    repo_copy.mkdir()
    for path in UNITS:
        shutil.copy(path, repo_copy / path.name)
    assert verify(repo_copy, [p.name for p in UNITS]) == []
    folder = written(tmp_path, "--generators", "2", "--mps", "on")
    assert verify(folder, ["epd.service", "epd-mps.service"]) == []
