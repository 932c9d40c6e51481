"""The launcher's placement plans (pure: nothing is started) and its command
line's one-line errors (the MPS config and --placement auto: test_auto_placement.py). Every plan test names the placement it checks:
dedicated is the reference design's layout (encoders first, one stage per
GPU, round-robin), colocated the default's (a generator on every GPU,
encoders on the emptiest GPU)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from pipeline.launch.placement import describe, place_stages
from pipeline.launch.plan import (
    HostFacts, LaunchError, LaunchOptions, generator_memory_shares, http_url, plan_stages,
    shared_gpus)

RUN = Path("/tmp/epd-test-run")  # only names addresses in plan tests; nothing is bound
MODEL = Path("/models/qwen2.5-vl-3b")


def options(**overrides) -> LaunchOptions:
    base = dict(encoders=1, generators=3, run_dir=RUN, model=MODEL, python="python")
    return LaunchOptions(**{**base, **overrides})


def flag_values(args, flag: str) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args) if a == flag]


def by_role(specs):
    return {role: [s for s in specs if s.role == role] for role in ("encoder", "generator", "proxy")}


# ---- plans ------------------------------------------------------------------

@pytest.mark.parametrize("placement, encoder_gpu, generator_gpus", [
    ("dedicated", 0, [1, 2, 3]),
    ("colocated", 3, [0, 1, 2]),   # the generators first; the free GPU takes the encoder
])
def test_one_encoder_three_generators_on_four_gpus(placement, encoder_gpu, generator_gpus):
    specs = plan_stages(options(placement=placement), HostFacts(gpu_count=4))
    assert [(s.instance, s.device) for s in specs] == [
        ("encoder-0", f"cuda:{encoder_gpu}"), *[(f"generator-{i}", f"cuda:{g}") for i, g in enumerate(generator_gpus)],
        ("proxy", "cpu")]
    assert shared_gpus(specs) == {}
    roles = by_role(specs)
    encoder, proxy = roles["encoder"][0], roles["proxy"][0]
    assert encoder.argv[:3] == ["python", "-m", "stages.encoder"]
    assert proxy.argv[:3] == ["python", "-m", "stages.proxy"]
    assert flag_values(encoder.args, "--device") == [f"cuda:{encoder_gpu}"]
    assert flag_values(encoder.args, "--instance") == ["encoder-0"]
    # Every stage that hashes content uses one model id.
    assert flag_values(encoder.args, "--model-id") == flag_values(proxy.args, "--model-id") == [MODEL.name]
    for gen in roles["generator"]:
        assert gen.argv[:3] == ["python", "-m", "stages.generator"]
        assert flag_values(gen.args, "--encoders") == [encoder.address]
        assert flag_values(gen.args, "--mode") == ["epd"]
        assert flag_values(gen.args, "--model") == [str(MODEL)]
    assert flag_values(proxy.args, "--encoders") == [encoder.address]
    assert flag_values(proxy.args, "--generators") == [g.address for g in roles["generator"]]
    assert flag_values(proxy.args, "--port") == ["8000"]
    assert flag_values(proxy.args, "--address") == [proxy.address]
    addresses = [s.address for s in specs]
    assert len(set(addresses)) == len(addresses) and all(a.startswith(f"ipc://{RUN}/") for a in addresses)
    for spec in specs:  # GPUs are named, never hidden
        assert "CUDA_VISIBLE_DEVICES" not in spec.env


def test_dedicated_fewer_gpus_than_stages_share_round_robin():
    specs = plan_stages(options(placement="dedicated"), HostFacts(gpu_count=2))
    assert [s.device for s in specs] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1", "cpu"]
    assert shared_gpus(specs) == {"cuda:0": ["encoder-0", "generator-1"],
                                  "cuda:1": ["generator-0", "generator-2"]}
    assert all(s.env.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID" for s in specs if s.role != "proxy")


def test_colocated_fewer_gpus_than_stages_put_the_encoder_on_the_emptier_gpu():
    """Generators round-robin (cuda:0 gets two), then the encoder joins the GPU
    with fewer stages."""
    specs = plan_stages(options(placement="colocated"), HostFacts(gpu_count=2))
    assert [s.device for s in specs] == ["cuda:1", "cuda:0", "cuda:1", "cuda:0", "cpu"]
    assert shared_gpus(specs) == {"cuda:1": ["encoder-0", "generator-1"],
                                  "cuda:0": ["generator-0", "generator-2"]}


def memory_share(spec) -> list[str]:
    return [a.split("=", 1)[1] for a in spec.args if a.startswith("--gpu-memory-utilization=")]


@pytest.mark.parametrize("placement, expected", [
    # dedicated: cuda:0 holds the encoder and generator-1 (0.9 - 0.1), cuda:1 two generators (0.45 each)
    ("dedicated", [("cuda:1", ["0.450"]), ("cuda:0", ["0.800"]), ("cuda:1", ["0.450"])]),
    # colocated: the same split on the other GPU numbers
    ("colocated", [("cuda:0", ["0.450"]), ("cuda:1", ["0.800"]), ("cuda:0", ["0.450"])]),
])
def test_generators_sharing_a_gpu_split_its_memory(placement, expected):
    """1 encoder + 3 generators on 2 GPUs; alone on a GPU a generator keeps
    its own default; the operator's flag wins."""
    specs = plan_stages(options(placement=placement), HostFacts(gpu_count=2))
    gens = by_role(specs)["generator"]
    assert [(g.device, memory_share(g)) for g in gens] == expected
    four = plan_stages(options(placement=placement), HostFacts(gpu_count=4))
    assert all(memory_share(g) == [] for g in by_role(four)["generator"])
    own = plan_stages(options(placement=placement, stage_args=(("generator", "--gpu-memory-utilization=0.3"),)),
                      HostFacts(gpu_count=2))
    assert all(memory_share(g) == ["0.3"] for g in by_role(own)["generator"])
    cpu = plan_stages(options(placement=placement, device="cpu"), HostFacts(gpu_count=0))
    assert all(memory_share(g) == [] for g in by_role(cpu)["generator"])
    with pytest.raises(LaunchError, match="no memory left"):
        plan_stages(options(placement=placement, encoders=9, generators=1), HostFacts(gpu_count=1))


def test_memory_shares_follow_the_colocated_placement_on_eight_gpus():
    """1E+8G: the encoder joins generator-0 on cuda:0 (0.9 - 0.1); the
    other seven generators are alone and keep their default."""
    specs = plan_stages(options(placement="colocated", encoders=1, generators=8), HostFacts(gpu_count=8))
    gens = by_role(specs)["generator"]
    assert [memory_share(g) for g in gens] == [["0.800"]] + [[]] * 7
    # Two encoders and two generators on one GPU: (0.9 - 2 * 0.1) / 2 each.
    assert generator_memory_shares(["cuda:0", "cuda:0"], ["cuda:0", "cuda:0", "cuda:1"], ()) == [
        ("--gpu-memory-utilization=0.350",), ("--gpu-memory-utilization=0.350",), ()]


@pytest.mark.parametrize("placement, expected", [
    ("dedicated", ["cuda:1", "cuda:3", "cuda:1", "cpu"]),
    ("colocated", ["cuda:1", "cuda:1", "cuda:3", "cpu"]),   # a tie of stages: the first GPU of the list
])
def test_gpu_subset(placement, expected):
    specs = plan_stages(options(encoders=1, generators=2, gpus=(1, 3), placement=placement), HostFacts(gpu_count=4))
    assert [s.device for s in specs] == expected
    with pytest.raises(LaunchError, match=r"--gpus 5: only 4 GPU\(s\)"):
        plan_stages(options(gpus=(0, 5), placement=placement), HostFacts(gpu_count=4))


@pytest.mark.parametrize("placement", ["dedicated", "colocated"])
def test_aggregated_mode_starts_no_encoders(placement):
    specs = plan_stages(options(encoders=0, generators=2, mode="aggregated", placement=placement),
                        HostFacts(gpu_count=2))
    roles = by_role(specs)
    assert roles["encoder"] == [] and len(roles["generator"]) == 2
    for spec in roles["generator"] + roles["proxy"]:
        assert flag_values(spec.args, "--mode") == ["aggregated"]
        assert flag_values(spec.args, "--encoders") == []
    assert [s.device for s in roles["generator"]] == ["cuda:0", "cuda:1"]


def test_builtin_tiny_model_serves_on_cpu_by_default():
    tiny = Path("/cache/epd/tiny-qwen2.5-vl-v1")
    specs = plan_stages(options(model=None), HostFacts(gpu_count=8, builtin_model=tiny))
    assert {s.device for s in specs} == {"cpu"}
    assert all(s.env == {} for s in specs)
    for spec in specs:
        assert flag_values(spec.args, "--model") == [str(tiny)]
    assert flag_values(specs[0].args, "--model-id") == ["tiny-qwen2.5-vl-v1"]
    # An explicit model id wins everywhere; cpu never touches GPUs.
    specs = plan_stages(options(model_id="qwen", device="cpu"), HostFacts(gpu_count=4))
    assert {s.device for s in specs} == {"cpu"}
    assert flag_values(specs[0].args, "--model-id") == flag_values(specs[-1].args, "--model-id") == ["qwen"]


def test_stages_on_the_cpu_split_its_cores_and_the_operator_wins():
    """torch's default (a thread per core in every process) oversubscribes a
    host the stages share; GPU stages keep it, and --stage-arg overrides."""
    cpu = plan_stages(options(device="cpu"), HostFacts(gpu_count=0, cpus=16))
    assert [flag_values(s.args, "--cpu-threads") for s in cpu] == [["4"]] * 4 + [[]]
    small = plan_stages(options(device="cpu"), HostFacts(gpu_count=0, cpus=2))
    assert {flag_values(s.args, "--cpu-threads")[0] for s in small if s.role != "proxy"} == {"1"}
    gpus = plan_stages(options(), HostFacts(gpu_count=4, cpus=16))
    assert all("--cpu-threads" not in s.args for s in gpus)
    own = plan_stages(options(device="cpu", stage_args=(("generator", "--cpu-threads=8"),)),
                      HostFacts(gpu_count=0, cpus=16))
    assert all(g.args[-2:] == ("4", "--cpu-threads=8") for g in by_role(own)["generator"])  # argparse: last wins


def test_dtype_and_stage_args_pass_through_in_order():
    opts = options(dtype="bfloat16", stage_args=(("generator", "--max-num-seqs=32"),
                                                 ("encoder", "--arena-mib"), ("encoder", "512")))
    roles = by_role(plan_stages(opts, HostFacts(gpu_count=4)))
    assert roles["encoder"][0].args[-2:] == ("--arena-mib", "512")
    assert all(g.args[-1] == "--max-num-seqs=32" for g in roles["generator"])
    assert all(flag_values(s.args, "--dtype") == ["bfloat16"] for s in roles["encoder"] + roles["generator"])
    assert "--dtype" not in roles["proxy"][0].args
    # The supervisor waits for the proxy's drain, so it must be the launcher's.
    assert flag_values(roles["proxy"][0].args, "--drain-timeout") == ["30"]
    proxy = by_role(plan_stages(options(drain_timeout=2.5), HostFacts(gpu_count=4)))["proxy"][0]
    assert flag_values(proxy.args, "--drain-timeout") == ["2.5"]


@pytest.mark.parametrize("placement, expected", [
    ("dedicated", ["cuda:0", "cuda:1", "cpu"]),
    ("colocated", ["cuda:1", "cuda:0", "cpu"]),
])
def test_random_weights_reach_the_model_stages_and_the_folder_every_stage(placement, expected):
    folder = Path("/cache/epd/qwen2.5-vl-3b-v1")
    opts = options(model=None, random_weights="qwen2.5-vl-3b", encoders=1, generators=1, placement=placement)
    specs = plan_stages(opts, HostFacts(gpu_count=2, builtin_model=folder))
    assert [s.device for s in specs] == expected  # device auto: a real-size shape uses GPUs
    roles = by_role(specs)
    for spec in roles["encoder"] + roles["generator"]:
        assert flag_values(spec.args, "--random-weights") == ["qwen2.5-vl-3b"]
    assert "--random-weights" not in roles["proxy"][0].args
    assert all(flag_values(s.args, "--model") == [str(folder)] for s in specs)
    assert flag_values(roles["proxy"][0].args, "--model-id") == ["qwen2.5-vl-3b-v1"]


# ---- the placements, GPU by GPU ------------------------------------------------

@pytest.mark.parametrize("gpus, encoders, generators, colocated, dedicated", [
    # 1E+3G: (encoder GPUs, generator GPUs) per placement
    (1, 1, 3, ([0], [0, 0, 0]), ([0], [0, 0, 0])),
    (2, 1, 3, ([1], [0, 1, 0]), ([0], [1, 0, 1])),
    (4, 1, 3, ([3], [0, 1, 2]), ([0], [1, 2, 3])),
    (8, 1, 3, ([3], [0, 1, 2]), ([0], [1, 2, 3])),   # cuda:4..7 unused either way
    (8, 1, 1, ([1], [0]), ([0], [1])),
    (8, 2, 4, ([4, 5], [0, 1, 2, 3]), ([0, 1], [2, 3, 4, 5])),
    (8, 1, 8, ([0], [0, 1, 2, 3, 4, 5, 6, 7]), ([0], [1, 2, 3, 4, 5, 6, 7, 0])),
])
@pytest.mark.parametrize("placement", ["colocated", "dedicated"])
def test_placements(placement, gpus, encoders, generators, colocated, dedicated):
    encoder_gpus, generator_gpus = colocated if placement == "colocated" else dedicated
    specs = plan_stages(options(encoders=encoders, generators=generators, placement=placement),
                        HostFacts(gpu_count=gpus))
    roles = by_role(specs)
    assert [s.device for s in roles["encoder"]] == [f"cuda:{g}" for g in encoder_gpus]
    assert [s.device for s in roles["generator"]] == [f"cuda:{g}" for g in generator_gpus]
    assert [flag_values(s.args, "--device") for s in roles["encoder"] + roles["generator"]] == [
        [f"cuda:{g}"] for g in encoder_gpus + generator_gpus]


def test_plan_stages_takes_the_options_placement_unless_told():
    facts = HostFacts(gpu_count=4)
    devices = lambda specs: [s.device for s in specs]  # noqa: E731
    colocated = ["cuda:3", "cuda:0", "cuda:1", "cuda:2", "cpu"]
    dedicated = ["cuda:0", "cuda:1", "cuda:2", "cuda:3", "cpu"]
    assert options().placement == "auto"
    assert devices(plan_stages(options(), facts)) == colocated   # auto without a choice: colocated
    assert devices(plan_stages(options(placement="dedicated"), facts)) == dedicated
    assert devices(plan_stages(options(), facts, "dedicated")) == dedicated   # the choice wins
    assert devices(plan_stages(options(placement="dedicated"), facts, "colocated")) == colocated


def test_colocated_takes_a_free_gpu_before_sharing_one():
    assert place_stages(1, 2, (0, 1, 2), "colocated") == [2, 0, 1]
    assert place_stages(2, 2, (0, 1, 2), "colocated") == [2, 0, 0, 1]   # then the first GPU
    assert place_stages(1, 2, (5, 7, 9), "colocated") == [9, 5, 7]     # GPU numbers, not indices


@pytest.mark.parametrize("encoders, generators, gpus", [(4, 2, 2), (3, 4, 4), (6, 2, 4), (5, 8, 8), (9, 3, 4)])
def test_colocated_spreads_encoders_evenly(encoders, generators, gpus):
    devices = place_stages(encoders, generators, tuple(range(gpus)), "colocated")
    on = lambda stages, gpu: stages.count(gpu)  # noqa: E731
    per_gpu_encoders = [on(devices[:encoders], g) for g in range(gpus)]
    per_gpu_stages = [on(devices, g) for g in range(gpus)]
    assert sum(per_gpu_encoders) == encoders
    assert max(per_gpu_encoders) - min(per_gpu_encoders) <= 1
    assert max(per_gpu_stages) - min(per_gpu_stages) <= 1
    assert devices[encoders:] == [g % gpus for g in range(generators)]


def test_colocated_spread_exactly():
    # Generators on 0 and 1; the encoders fill 2 and 3, then go round again.
    assert place_stages(6, 2, (0, 1, 2, 3), "colocated")[:6] == [2, 3, 0, 1, 2, 3]
    assert place_stages(4, 2, (0, 1), "colocated")[:4] == [0, 1, 0, 1]


@pytest.mark.parametrize("placement, gpus, message", [
    ("auto", (0,), "placement must be one of colocated, dedicated"),
    ("spread", (0,), "placement must be one of colocated, dedicated"),
    ("colocated", (), "no GPUs"),
])
def test_place_stages_refuses(placement, gpus, message):
    with pytest.raises(ValueError, match=message):
        place_stages(1, 1, gpus, placement)


def test_describe_lists_each_gpu_in_number_order_and_the_unused_ones():
    assert describe(["encoder-0", "generator-0", "generator-1"], ["cuda:10", "cuda:2", "cuda:10"],
                    (2, 3, 10)) == "cuda:2: generator-0; cuda:3: unused; cuda:10: encoder-0 + generator-1"
    assert describe(["encoder-0", "generator-0"], ["cpu", "cpu"]) == "cpu: encoder-0 + generator-0"


# ---- bad options ---------------------------------------------------------------------

@pytest.mark.parametrize("overrides, message", [
    (dict(random_weights="qwen-99b"), "--random-weights must be one of"),
    (dict(random_weights="qwen2.5-vl-3b"), "--model cannot be combined with --random-weights"),
    (dict(stage_args=(("encoder", "--random-weights=qwen2.5-vl-3b"),)), "--random-weights is set by the launcher"),
    (dict(encoders=0), "--encoders must be at least 1 in epd mode"),
    (dict(encoders=1, mode="aggregated"), "--encoders must be 0 with --mode aggregated"),
    (dict(generators=0), "--generators must be at least 1"),
    (dict(port=70000), r"--port must be in 1\.\.65535"),
    (dict(device="cpu", gpus=(0,)), "--gpus cannot be combined with --device cpu"),
    (dict(gpus=(0, 0)), "--gpus must be distinct"),
    (dict(device="tpu"), "--device must be one of auto, cpu, cuda"),
    (dict(stage_args=(("generator", "--device=cuda:3"),)), "--device is set by the launcher"),
    (dict(stage_args=(("proxy", "--generators"),)), "--generators is set by the launcher"),
    (dict(stage_args=(("decoder", "--x"),)), "role must be one of encoder, generator, proxy"),
    (dict(drain_timeout=-1.0), "--drain-timeout must be >= 0"),
    (dict(drain_timeout=float("nan")), "--drain-timeout must be >= 0"),
    (dict(stage_args=(("proxy", "--drain-timeout=5"),)), "--drain-timeout is set by the launcher"),
    (dict(placement="x"), "--placement must be one of colocated, dedicated, auto"),
    (dict(mps="x"), "--mps must be one of auto, on, off"),
    (dict(encoder_sm_percent=0), r"--encoder-sm-percent must be in 1\.\.100 \(got 0\)"),
    (dict(encoder_sm_percent=101), r"--encoder-sm-percent must be in 1\.\.100 \(got 101\)"),
    (dict(encoder_sm_percent=50, mps="off"), "--encoder-sm-percent needs MPS"),
    (dict(encoder_priority="below-normal", mps="off"), "--encoder-priority needs MPS"),
    (dict(encoder_priority="low"), "--encoder-priority"),
])
def test_bad_options_are_one_line_errors(overrides, message):
    with pytest.raises(LaunchError, match=message) as info:
        options(**overrides)
    assert "\n" not in str(info.value)


def test_cuda_without_gpus_is_an_error():
    with pytest.raises(LaunchError, match="no CUDA GPU is visible"):
        plan_stages(options(device="cuda"), HostFacts(gpu_count=0))
    # auto with a real model and no GPU: the CPU.
    assert {s.device for s in plan_stages(options(), HostFacts(gpu_count=0))} == {"cpu"}


def test_urls():
    assert http_url("127.0.0.1", 8000, "/v1") == "http://127.0.0.1:8000/v1"
    assert http_url("0.0.0.0", 80, "/health", for_client=True) == "http://127.0.0.1:80/health"
    assert http_url("::", 80, "/health", for_client=True) == "http://[::1]:80/health"


@pytest.mark.parametrize("argv, message", [
    (["--generators", "0"], "--generators must be at least 1"),
    (["--mode", "aggregated", "--encoders", "2"], "--encoders must be 0 with --mode aggregated"),
    (["--port", "99999"], "--port must be in 1..65535"),
    (["--stage-arg", "generator"], "expected ROLE=ARG"),
    (["--placement", "nowhere"], "argument --placement: invalid choice: 'nowhere'"),
    (["--mps", "sometimes"], "argument --mps: invalid choice: 'sometimes'"),
    (["--encoder-sm-percent", "101"], "--encoder-sm-percent must be in 1..100"),
    (["--encoder-sm-percent", "50", "--mps", "off"], "--encoder-sm-percent needs MPS"),
])
def test_cli_rejects_bad_options_with_exit_2(argv, message):
    result = subprocess.run([sys.executable, str(REPO / "bin" / "epd-launch"), *argv],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and message in result.stderr
    assert result.stderr.startswith("epd-launch: error: ")


def test_cli_refuses_a_port_in_use():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run([sys.executable, str(REPO / "bin" / "epd-launch"), "--port", str(port)],
                                capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert result.stderr.startswith(f"epd-launch: error: --port {port}: cannot listen on 127.0.0.1")


def test_the_api_flags_reach_the_proxy_and_parse_there(tmp_path):
    """epd-launch's --served-model-name, --api-key and --allowed-origins, as the
    proxy's own flags; the proxy's parser takes what the plan hands it."""
    from pipeline.launch import cli as script

    args = script.parse_args(["--served-model-name", "a", "b", "--api-key", "k", "--allowed-origins", '["https://x"]'])
    proxy = by_role(plan_stages(options(stage_args=script.forwarded_stage_args(args)), HostFacts(gpu_count=4)))["proxy"][0]
    from stages.proxy import parse_args as proxy_args

    parsed = proxy_args(list(proxy.args))
    assert parsed.served_model_name == ["a", "b"] and parsed.api_key == "k"
    assert parsed.allowed_origins == ["https://x"]
