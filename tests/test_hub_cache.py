"""A checkpoint named by its Hugging Face repo id, as `vllm serve ORG/NAME`
names one: found in the local Hugging Face cache (HF_HUB_CACHE), never
downloaded; a folder still wins; a missing id is one line saying how to
fetch it (pipeline/models/hub_cache.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.models.hub_cache import model_dir_arg

REPO = Path(__file__).resolve().parents[1]
REPO_ID = "acme/tiny-vl"


@pytest.fixture
def hub(tmp_path, tiny_dir) -> tuple[dict, Path]:
    """A Hugging Face cache holding the tiny checkpoint as acme/tiny-vl (the
    layout huggingface_hub writes: refs/main names the snapshot), and the
    environment that points huggingface_hub at it, offline."""
    repo = tmp_path / "hub" / "models--acme--tiny-vl"
    snapshot = repo / "snapshots" / "0123abcd"
    shutil.copytree(tiny_dir, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    return env, snapshot


def run(env: dict, *argv: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=180, env=env, cwd=cwd)


def generated(env: dict, model: str) -> dict:
    result = run(env, str(REPO / "bin" / "epd-generate"), "--model", model, "--prompt", "Hello there",
                 "--max-tokens", "6", "--device", "cpu", "--ignore-eos", "--json")
    assert result.returncode == 0, result.stderr[-2000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_cached_repo_id_serves_the_same_checkpoint_as_its_folder(hub):
    env, snapshot = hub
    by_id = generated(env, REPO_ID)
    assert by_id == generated(env, str(snapshot)) and len(by_id["token_ids"]) == 6


def test_the_launcher_takes_the_id_as_vllm_serve_does_and_writes_its_folder(hub, tmp_path):
    env, snapshot = hub
    folder = tmp_path / "units"
    result = run(env, str(REPO / "bin" / "epd-launch"), REPO_ID, "--device", "cpu", "--write-systemd", str(folder))
    assert result.returncode == 0, result.stderr
    assert f"model: {snapshot}" in (folder / "epd.yaml").read_text()   # the unit serves that snapshot


def test_a_repo_id_not_in_the_cache_is_one_line_saying_how_to_fetch_it(hub, tmp_path):
    env, _ = hub
    result = run(env, str(REPO / "bin" / "epd-launch"), "acme/missing", "--device", "cpu")
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert str(tmp_path / "hub") in result.stderr and "huggingface-cli download acme/missing" in result.stderr
    twice = run(env, str(REPO / "bin" / "epd-launch"), REPO_ID, "--model", "/elsewhere", "--device", "cpu")
    assert twice.returncode == 2 and "the model is given twice" in twice.stderr


def test_a_folder_wins_over_an_id_of_the_same_name_and_other_paths_pass_as_given(tmp_path, monkeypatch):
    (tmp_path / "acme" / "tiny-vl").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert model_dir_arg(REPO_ID) == Path(REPO_ID)   # a folder here: no cache lookup
    assert model_dir_arg("/no/such/folder") == Path("/no/such/folder")   # the loader refuses it by name
    assert model_dir_arg("~/x") == Path.home() / "x"
