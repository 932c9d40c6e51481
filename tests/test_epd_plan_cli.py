"""bin/epd-plan end to end on the CPU: one small measurement of the built-in
tiny model (this process and a load child, ~20 s) shared by the whole file,
then planning from it, and the one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from pipeline.planner.capacity import candidate_layouts
from pipeline.planner.profile import FORMAT, load_profile

EPD_PLAN = str(REPO / "bin" / "epd-plan")
# Decode batches far apart: on a noisy CPU a 1-vs-2 pair sometimes times the
# larger batch faster (the planner floors such a curve: see test_planner's
# test_a_falling_decode_curve_does_not_crash_the_planner).
MEASURE = ["--repeats", "3", "--vision-batches", "1,2", "--decode-batches", "1,16", "--prefill-tokens", "32,64",
           "--image-sizes", "224x224",
           "--beside-wall-s", "0.2"]


def epd_plan(*argv: str, env: dict | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, EPD_PLAN, *argv], capture_output=True, text=True, timeout=timeout,
                          env=env)


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """(the profile file, the cache folder, the run's stderr)."""
    folder = tmp_path_factory.mktemp("epd-plan")
    cache = folder / "cache"
    out = folder / "box.json"
    env = {**os.environ, "EPD_CACHE_DIR": str(cache)}
    result = epd_plan("--profile-out", str(out), *MEASURE, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    return out, cache, result.stderr


def test_profile_out_measures_every_point_alone_and_beside(measured):
    out, _, _ = measured
    profile = load_profile(out)
    assert profile.format == FORMAT and profile.device_name == "cpu" and profile.gpu_count == 0
    assert profile.dtype == "float32" and profile.mps is False
    assert sorted((p.width, p.height, p.batch) for p in profile.vision) == [(224, 224, 1), (224, 224, 2)]
    # 224x224 in 14-pixel patches merged 2x2: (224 / 28) ** 2 visual tokens.
    assert {p.tokens for p in profile.vision} == {64}
    assert sorted(p.batch for p in profile.decode) == [1, 16]
    assert sorted(p.tokens for p in profile.prefill) == [32, 64]
    for point in [*profile.vision, *profile.decode, *profile.prefill]:
        assert point.alone_s > 0 and point.beside_s is not None and point.beside_s > 0, point
        assert point.beside_half_s is not None and point.beside_half_s > 0, point   # beside a load at half duty


def test_profile_out_leaves_a_copy_in_the_cache(measured):
    out, cache, stderr = measured
    profile = load_profile(out)
    cached = cache / "profiles" / f"{profile.model_id}@cpu.json"
    assert cached.is_file() and load_profile(cached) == profile
    assert f"epd-plan: wrote {out}\n" in stderr and f"epd-plan: wrote {cached}\n" in stderr


def test_plan_json_lists_every_candidate_and_the_chosen_one(measured):
    out, _, _ = measured
    # SLOs no CPU misses, however loaded: every layout then has a rate.
    result = epd_plan("--profile", str(out), "--gpus", "2", "--images", "1", "--image-size", "224x224", "--json",
                      "--slo-ttft-ms", "1e7", "--slo-tpot-ms", "1e7")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    layouts = report["layouts"]
    assert [(l["encoders"], l["generators"], l["placement"]) for l in layouts] == [
        (l.encoders, l.generators, l.placement) for l in candidate_layouts(2)]
    for layout in layouts:
        assert layout["gpus"] == 2 and layout["max_rate"] > 0 and isinstance(layout["bound"], str)
    assert report["chosen"] in layouts
    assert report["chosen"]["max_rate"] >= 0.99 * max(l["max_rate"] for l in layouts)
    assert report["workload"]["image_tokens"] == 64 and report["workload"]["images"] == 1


def test_plan_table_ends_with_the_chosen_line(measured):
    out, _, _ = measured
    result = epd_plan("--profile", str(out), "--gpus", "2", "--images", "1", "--image-size", "224x224")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[-1].startswith("chosen: ") and "req/s, bound: " in lines[-1]
    rows = lines[2:-1]   # a header line, the column titles, one row a layout
    assert len(rows) == len(candidate_layouts(2))
    assert lines[-1].split("chosen: ")[1].split(" (")[0] in [row[:36].strip() for row in rows]


@pytest.mark.parametrize("argv, code, words", [
    (["--gpus", "0"], 2, "--gpus '0': want whole numbers >= 1"),
    (["--image-size", "12"], 2, "image size '12': want WIDTHxHEIGHT"),
    (["--profile-out", "other.json"], 2, "not allowed with argument"),
    (["--images", "1", "--json"], None, None),   # a control: these settings plan fine
])
def test_bad_plan_arguments_are_one_line(measured, argv, code, words):
    out, _, _ = measured
    result = epd_plan("--profile", str(out), *argv)
    if code is None:
        assert result.returncode == 0 and result.stderr == "", result.stderr
        return
    assert result.returncode == code and result.stdout == ""
    assert result.stderr.startswith("epd-plan: error: ") and result.stderr.count("\n") == 1
    assert words in result.stderr


def test_neither_mode_is_a_one_line_error():
    result = epd_plan("--gpus", "2")
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "one of the arguments --profile-out --profile is required" in result.stderr


def test_a_missing_or_malformed_profile_exits_1_with_one_line(tmp_path):
    missing = tmp_path / "missing.json"
    result = epd_plan("--profile", str(missing), "--gpus", "2")
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr == f"epd-plan: error: {missing}: No such file or directory\n"
    junk = tmp_path / "junk.json"
    junk.write_text('{"format": "epd-profile/1"}')
    result = epd_plan("--profile", str(junk), "--gpus", "2")
    assert result.returncode == 1 and result.stderr.count("\n") == 1
    assert result.stderr.startswith(f"epd-plan: error: {junk}: not an EPD profile: ")
