"""What the launcher decides before it starts anything: the MPS daemon it
runs (plan.mps_config) and where --placement auto puts the stages
(auto_placement.choose_placement), on hand-made profiles."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from planner_helpers import make_profile
from pipeline.launch.auto_placement import PlanWorkload, choose_placement
from pipeline.launch.placement import place_stages
from pipeline.launch.plan import HostFacts, LaunchError, mps_config, plan_stages, shared_gpus
from pipeline.planner.cache import cached_profile_path
from pipeline.planner.capacity import Layout, Workload, predict
from pipeline.planner.profile import image_tokens, save_profile
from test_launch_plan import MODEL, options


# ---- MPS ------------------------------------------------------------------------

MODEL_STAGES = ["encoder-0", "generator-0", "generator-1", "generator-2"]


def test_mps_auto_with_a_shared_gpu_takes_every_cuda_stage(tmp_path):
    opts = options(placement="colocated")
    specs = plan_stages(opts, HostFacts(gpu_count=2))
    config = mps_config(opts, specs, tmp_path)
    assert config is not None
    assert config.clients == frozenset(MODEL_STAGES)   # every CUDA stage, the proxy not
    assert config.encoders == frozenset({"encoder-0"})
    assert config.root == tmp_path / "mps"
    assert config.required is False and config.encoder_sm_percent is None
    assert set(config.shared) == {"cuda:0", "cuda:1"}


def test_mps_clients_include_stages_alone_on_a_gpu(tmp_path):
    """2E+2G colocated on 3 GPUs: cuda:0 is shared; the encoder alone on
    cuda:2 is a client too (CUDA IPC stays within one daemon)."""
    opts = options(encoders=2, generators=2, placement="colocated")
    specs = plan_stages(opts, HostFacts(gpu_count=3))
    assert [s.device for s in specs[:4]] == ["cuda:2", "cuda:0", "cuda:0", "cuda:1"]
    config = mps_config(opts, specs, tmp_path)
    assert config.clients == frozenset({"encoder-0", "encoder-1", "generator-0", "generator-1"})
    assert config.encoders == frozenset({"encoder-0", "encoder-1"})
    assert config.shared == ("cuda:0",)


@pytest.mark.parametrize("placement", ["colocated", "dedicated"])
def test_mps_auto_without_sharing_is_none(tmp_path, placement):
    opts = options(placement=placement)
    specs = plan_stages(opts, HostFacts(gpu_count=4))
    assert shared_gpus(specs) == {}
    assert mps_config(opts, specs, tmp_path) is None


def test_mps_off_is_none_even_with_a_shared_gpu(tmp_path):
    opts = options(mps="off", placement="colocated")
    specs = plan_stages(opts, HostFacts(gpu_count=1))
    assert shared_gpus(specs)
    assert mps_config(opts, specs, tmp_path) is None


def test_mps_on_without_a_gpu_stage_is_an_error(tmp_path):
    opts = options(mps="on", device="cpu")
    with pytest.raises(LaunchError, match="--mps on: no stage runs on a GPU") as info:
        mps_config(opts, plan_stages(opts, HostFacts(gpu_count=4)), tmp_path)
    assert "\n" not in str(info.value)
    # auto on the CPU: simply no daemon.
    cpu = options(device="cpu")
    assert mps_config(cpu, plan_stages(cpu, HostFacts(gpu_count=0)), tmp_path) is None


def test_mps_on_without_sharing_is_a_required_daemon(tmp_path):
    opts = options(mps="on", placement="dedicated", encoder_sm_percent=30)
    specs = plan_stages(opts, HostFacts(gpu_count=4))
    config = mps_config(opts, specs, tmp_path)
    assert config is not None and config.required is True
    assert config.clients == frozenset(MODEL_STAGES) and config.shared == ()
    assert config.encoder_sm_percent == 30 and config.encoders == frozenset({"encoder-0"})


def test_encoder_sm_percent_and_priority_reach_the_config(tmp_path):
    opts = options(placement="colocated", encoder_sm_percent=25)
    config = mps_config(opts, plan_stages(opts, HostFacts(gpu_count=1)), tmp_path)
    assert config.encoder_sm_percent == 25 and config.required is False and not config.encoder_below_normal
    opts = options(placement="colocated", encoder_priority="below-normal")
    config = mps_config(opts, plan_stages(opts, HostFacts(gpu_count=1)), tmp_path)
    assert config.encoder_below_normal and config.encoder_sm_percent is None


# ---- --placement auto -----------------------------------------------------------------

GPU_NAME = "NVIDIA Test GPU"


def write_profile(path: Path, **curves) -> Path:
    save_profile(make_profile(**curves), path)
    return path


def default_workload(profile) -> Workload:
    """PlanWorkload's defaults, as choose_placement turns them into a Workload."""
    return Workload(1, image_tokens(profile, 640, 640), 400, 150, 2.0, 0.05)


@pytest.mark.parametrize("placement", ["colocated", "dedicated"])
def test_a_concrete_placement_is_taken_as_asked(tmp_path, placement):
    profile = write_profile(tmp_path / "p.json")
    choice = choose_placement(options(placement=placement, profile=profile), HostFacts(gpu_count=4), MODEL.name)
    assert (choice.placement, choice.reason) == (placement, "as asked (--placement)")


@pytest.mark.parametrize("overrides, facts, placement, words", [
    (dict(device="cpu"), HostFacts(gpu_count=4), "colocated", "CPU"),
    (dict(model=None), HostFacts(gpu_count=4, builtin_model=Path("/cache/tiny")), "colocated", "CPU"),
    (dict(encoders=0, generators=4, mode="aggregated"), HostFacts(gpu_count=4), "dedicated", "aggregated"),
    (dict(), HostFacts(gpu_count=1), "colocated", "one GPU"),
    (dict(gpus=(2,)), HostFacts(gpu_count=4), "colocated", "one GPU"),
])
def test_auto_without_a_choice_to_make(tmp_path, overrides, facts, placement, words):
    profile = write_profile(tmp_path / "p.json", vision_beside=10.0, generator_beside=10.0)
    choice = choose_placement(options(profile=profile, **overrides), facts, MODEL.name)
    assert choice.placement == placement and words in choice.reason


def test_auto_without_a_profile_colocates_and_says_how_to_measure_one(tmp_path, monkeypatch):
    monkeypatch.setenv("EPD_CACHE_DIR", str(tmp_path / "empty-cache"))
    for facts in (HostFacts(gpu_count=4), HostFacts(gpu_count=4, gpu_name=GPU_NAME)):
        choice = choose_placement(options(), facts, MODEL.name)
        assert choice.placement == "colocated"
        assert "without a profile" in choice.reason and "epd-plan --profile-out" in choice.reason


@pytest.mark.parametrize("content, words", [(None, "No such file"), ("{}", "not an EPD profile"),
                                            ('{"format": "epd-profile/1"', "not an EPD profile")])
def test_a_profile_flag_that_cannot_be_read_is_a_one_line_error(tmp_path, content, words):
    """A --profile the operator named is never taken for "no profile"."""
    path = tmp_path / "p.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(LaunchError) as info:
        choose_placement(options(profile=path), HostFacts(gpu_count=4), MODEL.name)
    message = str(info.value)
    assert message.startswith(f"--profile {path}: ") and words in message and "\n" not in message


def test_the_cached_profile_is_found_by_model_and_gpu_name(tmp_path, monkeypatch):
    monkeypatch.setenv("EPD_CACHE_DIR", str(tmp_path / "cache"))
    cached = write_profile(cached_profile_path(MODEL.name, GPU_NAME))
    assert cached.is_relative_to(tmp_path / "cache")
    choice = choose_placement(options(), HostFacts(gpu_count=4, gpu_name=GPU_NAME), MODEL.name)
    assert choice.reason.startswith(f"auto from {cached}: predicted ")
    # Another GPU kind has no profile; a spoiled cached one is skipped, saying why.
    other = choose_placement(options(), HostFacts(gpu_count=4, gpu_name="Another GPU"), MODEL.name)
    assert "without a profile" in other.reason
    cached.write_text("{}")
    spoiled = choose_placement(options(), HostFacts(gpu_count=4, gpu_name=GPU_NAME), MODEL.name)
    assert spoiled.placement == "colocated" and "the cached profile is unusable" in spoiled.reason
    assert str(cached) in spoiled.reason and "\n" not in spoiled.reason


def rate_in(reason: str) -> str:
    found = re.search(r"predicted (\S+) req/s \(bound: \w+\)", reason)
    assert found, reason
    return found.group(1)


@pytest.mark.parametrize("beside", [1.0, 10.0])
def test_auto_colocates_and_names_the_predicted_rate(tmp_path, beside):
    """For given counts both placements put the same stages together, so auto
    colocates whatever sharing costs; the reason names the prediction for
    the asked layout, the workload, and the profile."""
    path = write_profile(tmp_path / "p.json", vision_beside=beside, generator_beside=beside)
    choice = choose_placement(options(profile=path), HostFacts(gpu_count=4), MODEL.name, PlanWorkload())
    assert choice.placement == "colocated"
    profile = make_profile(vision_beside=beside, generator_beside=beside)
    expected = predict(profile, default_workload(profile), Layout(1, 3, "colocated", 4))
    assert rate_in(choice.reason) == f"{expected.max_rate:.1f}"
    assert f"auto from {path}" in choice.reason and "1 image(s) of 640x640, 400 text tokens" in choice.reason


@pytest.mark.parametrize("encoders, generators", [(1, 3), (2, 4), (1, 1)])
def test_colocated_and_dedicated_share_gpus_alike_for_given_counts(encoders, generators):
    """Why auto need not choose between them: the multiset of per-GPU stage mixes is the same."""
    for gpus in (1, 2, 4, 8):
        mixes = []
        for placement in ("colocated", "dedicated"):
            devices = place_stages(encoders, generators, tuple(range(gpus)), placement)
            roles = ["e"] * encoders + ["g"] * generators
            mixes.append(sorted("".join(sorted(r for r, d in zip(roles, devices) if d == g)) for g in range(gpus)))
        assert mixes[0] == mixes[1], (encoders, generators, gpus)


def test_auto_says_when_the_profile_favours_other_stage_counts(tmp_path):
    """1 encoder + 3 generators asked on 4 GPUs, but the profile (here: an
    encoder beside every generator costs nothing) favours another layout."""
    path = write_profile(tmp_path / "p.json")
    choice = choose_placement(options(profile=path), HostFacts(gpu_count=4), MODEL.name)
    assert "the profile favours colocated " in choice.reason
    favoured = re.search(r"favours colocated (\d+)E\+(\d+)G on 4 GPU", choice.reason)
    encoders, generators = int(favoured.group(1)), int(favoured.group(2))
    assert (encoders, generators) != (1, 3)
    asked = choose_placement(options(profile=path, encoders=encoders, generators=generators),
                             HostFacts(gpu_count=4), MODEL.name)
    assert "favours" not in asked.reason


