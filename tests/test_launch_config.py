"""epd-launch's config file (pipeline/launch/config.py) and its vllm-serve-named
engine flags: each key type, an unknown key, bad values (the error names the
key and what it takes), the command line over the file, and the flags as the
stages' own parsers take them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from pipeline.launch import cli
from pipeline.launch.config import ConfigError, LaunchFile, as_flags, load_config
from pipeline.launch.plan import HostFacts, plan_stages


def write(tmp_path, text: str):
    path = tmp_path / "epd.yaml"
    path.write_text(text)
    return path


def test_every_key_type_becomes_the_flags_the_launcher_parses(tmp_path):
    path = write(tmp_path, """
generators: 3
encoders: 1
port: 8123
mode: aggregated
dtype: auto
gpus: [0, 2]
slo-ttft-ms: 1500
served_model_name: [qwen, default]      # underscores work as well as dashes
allowed-origins: ["https://a.example"]
gpu-memory-utilization: 0.8
max-num-seqs: 32
limit-mm-per-prompt: {image: 4, video: 1}
stage-arg: [generator=--block-size=32]
""")
    args = cli.parse_args(["--config", str(path)])
    assert (args.generators, args.encoders, args.port, args.mode, args.gpus) == (3, 1, 8123, "aggregated", (0, 2))
    assert args.dtype is None and args.slo_ttft_ms == 1500.0
    assert args.served_model_name == ["qwen", "default"] and args.allowed_origins == '["https://a.example"]'
    assert args.limit_mm_per_prompt == {"image": 4, "video": 1}
    forwarded = cli.forwarded_stage_args(args)
    assert ("generator", "--gpu-memory-utilization=0.8") in forwarded
    assert ("generator", "--max-num-seqs=32") in forwarded and ("proxy", "--max-images=5") in forwarded
    assert args.stage_arg == [("generator", "--block-size=32")]


def test_the_command_line_overrides_the_file_and_adds_to_its_lists(tmp_path):
    path = write(tmp_path, "port: 8123\nmax-num-seqs: 32\nstage-arg: [generator=--block-size=32]\n")
    args = cli.parse_args(["--port", "9000", "--config", str(path), "--stage-arg", "proxy=--max-images=2"])
    assert args.port == 9000 and args.max_num_seqs == 32
    assert args.stage_arg == [("generator", "--block-size=32"), ("proxy", "--max-images=2")]


@pytest.mark.parametrize("text, named", [
    ("max-num-seq: 3\n", "max-num-seq"),                            # unknown key
    ("port: eighty\n", "$.port"),                                   # wrong type
    ("mode: fast\n", "allowed: epd, aggregated"),                   # not one of a fixed set
    ("gpus: [0, x]\n", "$.gpus[1]"),
    ("limit-mm-per-prompt: {image: many}\n", "$.limit-mm-per-prompt"),
    ("- just\n- a list\n", "want a mapping"),
    ("port: [\n", "not YAML"),
])
def test_a_bad_file_is_one_error_naming_the_key(tmp_path, text, named):
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, text))
    assert named in str(caught.value)


def test_a_bad_file_exits_2_with_one_line(tmp_path):
    path = write(tmp_path, "mode: fast\n")
    result = subprocess.run([sys.executable, str(REPO / "bin" / "epd-launch"), "--config", str(path)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "$.mode" in result.stderr and "allowed: epd, aggregated" in result.stderr


def test_every_launcher_flag_is_a_config_key_and_back():
    """The schema and the parser list the same settings (a new flag needs its key)."""
    parser_flags = {a.dest for a in cli.build_parser()._actions if a.option_strings and a.dest != "help"}
    assert parser_flags - {"config", "write_systemd"} == set(LaunchFile.__struct_fields__)


def test_the_engine_flags_parse_in_the_generator_and_the_proxy(tiny_dir):
    from stages.generator import parse_args as generator_args
    from stages.proxy import parse_args as proxy_args

    args = cli.parse_args(["--model", str(tiny_dir), "--device", "cpu", "--max-model-len", "1024",
                           "--gpu-memory-utilization", "0.7", "--max-num-seqs", "8", "--max-num-batched-tokens",
                           "4096", "--limit-mm-per-prompt", '{"image": 2}'])
    specs = plan_stages(cli.build_options(args), HostFacts(gpu_count=0))
    generator = next(s for s in specs if s.role == "generator")
    parsed = generator_args(list(generator.args))
    assert (parsed.gpu_memory_utilization, parsed.max_num_seqs, parsed.max_num_batched_tokens) == (0.7, 8, 4096)
    assert parsed.max_model_len == 1024   # its KV cache is checked against it at start-up
    assert parsed.enforce_eager is False
    assert parsed.prefill_pacing_ms is None   # off unless asked for
    proxy = next(s for s in specs if s.role == "proxy")
    parsed = proxy_args(list(proxy.args))
    assert parsed.max_images == 2 and parsed.max_model_len == 1024


def test_prefill_pacing_from_a_file_reaches_every_generator(tmp_path, tiny_dir):
    from stages.generator import parse_args as generator_args

    text = "prefill-pacing-ms: 14\nprefill_pacing_max_hold_ms: 250\ngenerators: 2\n"
    args = cli.parse_args(["--config", str(write(tmp_path, text)), "--model", str(tiny_dir), "--device", "cpu"])
    generators = [s for s in plan_stages(cli.build_options(args), HostFacts(gpu_count=0)) if s.role == "generator"]
    assert len(generators) == 2
    for spec in generators:
        parsed = generator_args(list(spec.args))
        assert (parsed.prefill_pacing_ms, parsed.prefill_pacing_max_hold_ms) == (14.0, 250.0)


@pytest.mark.parametrize("flag", ["--prefill-pacing-ms=0", "--prefill-pacing-max-hold-ms=-1"])
def test_bad_pacing_exits_2_naming_the_flag(tiny_dir, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.parse_args(["--model", str(tiny_dir), "--device", "cpu", flag])
    assert exc.value.code == 2 and flag.partition("=")[0] in capsys.readouterr().err


def test_encode_fallback_goes_to_the_generators_and_the_proxy(tmp_path, tiny_dir, capsys):
    from stages.generator import parse_args as generator_args
    from stages.proxy import parse_args as proxy_args

    args = cli.parse_args(["--config", str(write(tmp_path, "encode-fallback: local\n")), "--model", str(tiny_dir),
                           "--device", "cpu"])
    specs = plan_stages(cli.build_options(args), HostFacts(gpu_count=0))
    parsed = {s.role: (generator_args if s.role == "generator" else proxy_args)(list(s.args))
              for s in specs if s.role != "encoder"}
    assert parsed["generator"].encode_fallback == "local" and parsed["proxy"].encode_fallback == "local"
    assert "--encode-fallback=local" not in " ".join(a for s in specs if s.role == "encoder" for a in s.args)
    default = plan_stages(cli.build_options(cli.parse_args(["--model", str(tiny_dir), "--device", "cpu"])),
                          HostFacts(gpu_count=0))
    assert not any("--encode-fallback" in a for s in default for a in s.args)
    with pytest.raises(SystemExit):
        cli.parse_args(["--mode", "aggregated", "--encode-fallback", "local"])
    assert "--encode-fallback is for --mode epd" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="allowed: off, local"):
        load_config(write(tmp_path, "encode-fallback: remote\n"))


def test_a_file_of_every_key_round_trips():
    every = LaunchFile(generators=2, served_model_name="one", gpus=[1], allowed_origins=["*"],
                       limit_mm_per_prompt={"image": 1}, stage_arg=["proxy=--max-images=3"])
    args = cli.parse_args(as_flags(every))
    assert args.generators == 2 and args.served_model_name == ["one"] and args.gpus == (1,)


VLLM_LINE = ["--trust-remote-code", "-tp", "1", "-pp", "1", "--data-parallel-size", "1", "--kv-cache-dtype", "auto",
             "--load-format", "safetensors", "--enable-chunked-prefill", "--disable-uvicorn-access-log", "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
             "--generation-config", "vllm", "--allowed-local-media-path", "/data/media",
             "--enable-prompt-tokens-details", "--allowed-media-domains", "a.example", "b.example",
             "--trust-request-chat-template", "--disable-log-stats", "--disable-log-requests", "--enable-log-requests"]


def proxy_of(args):
    from stages.proxy import parse_args as proxy_args
    specs = plan_stages(cli.build_options(args), HostFacts(gpu_count=0))
    return proxy_args(list(next(s for s in specs if s.role == "proxy").args))


def test_a_vllm_serve_command_line_carries_over(tiny_dir):
    args = cli.parse_args([str(tiny_dir), "--device", "cpu", *VLLM_LINE])
    assert args.model == tiny_dir and args.trust_remote_code and args.tensor_parallel_size == 1
    proxy = proxy_of(args)
    assert proxy.generation_config == "vllm" and [str(p) for p in proxy.allow_file_dir] == ["/data/media"]
    assert proxy.allowed_media_domains == ["a.example", "b.example"] and proxy.enable_prompt_tokens_details
    assert proxy.trust_request_chat_template and proxy.disable_log_requests and proxy.disable_log_stats
    specs = plan_stages(cli.build_options(args), HostFacts(gpu_count=0))
    assert all("--disable-log-stats" in s.args and "--disable-log-requests" in s.args for s in specs)
    plain = proxy_of(cli.parse_args([str(tiny_dir), "--device", "cpu"]))
    assert not plain.enable_prompt_tokens_details and not plain.trust_request_chat_template


def test_the_positional_model_overrides_the_files_model(tmp_path, tiny_dir):
    path = write(tmp_path, "model: /somewhere/else\n")
    assert cli.parse_args(["--config", str(path), str(tiny_dir), "--device", "cpu"]).model == tiny_dir
    assert cli.parse_args(["--config", str(path), "--device", "cpu"]).model == Path("/somewhere/else")


def test_the_vllm_flags_round_trip_through_a_config_file(tmp_path, tiny_dir):
    text = ("trust-remote-code: true\nenforce-eager: true\nenable-auto-tool-choice: false\ntool-call-parser: hermes\n"
            "allowed-media-domains: [c.example]\ngeneration-config: auto\nkv-cache-dtype: auto\n"
            "enable-chunked-prefill: true\npipeline-parallel-size: 1\n")
    args = cli.parse_args(["--config", str(write(tmp_path, text)), "--model", str(tiny_dir), "--device", "cpu"])
    assert args.trust_remote_code and not args.enable_auto_tool_choice and args.tool_call_parser == "hermes"
    assert proxy_of(args).allowed_media_domains == ["c.example"]
    from stages.generator import parse_args as generator_args
    specs = plan_stages(cli.build_options(args), HostFacts(gpu_count=0))
    assert generator_args(list(next(s for s in specs if s.role == "generator").args)).enforce_eager


@pytest.mark.parametrize("flags, named", [
    (["--tensor-parallel-size", "2"], "--tensor-parallel-size 2: a generator runs on one GPU"),
    (["-tp", "4"], "use --generators N"),
    (["--tool-call-parser", "mistral"], "--tool-call-parser mistral: the proxy parses hermes"),
    (["-pp", "2"], "--pipeline-parallel-size 2: a generator runs on one GPU"),
    (["--data-parallel-size", "2"], "--data-parallel-size 2: each generator is one engine"),
    (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8: the KV cache is kept in the model's dtype"),
    (["--load-format", "pt"], "--load-format pt: checkpoints are read from their safetensors files"),
    (["--no-enable-chunked-prefill"], "--no-enable-chunked-prefill: prefill is always chunked here"),
])
def test_vllm_flags_whose_meaning_does_not_hold_here_exit_2_in_one_line(flags, named, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.parse_args(["--device", "cpu", *flags])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1 and named in err


@pytest.mark.parametrize("text, flags, on", [
    ("", [], True),   # vLLM's default, and the generator's
    ("enable-prefix-caching: false\n", ["--no-enable-prefix-caching"], False),
    ("enable-prefix-caching: true\n", ["--enable-prefix-caching"], True),
])
def test_prefix_caching_from_a_config_file_reaches_the_generators(tmp_path, tiny_dir, text, flags, on):
    path = write(tmp_path, text)
    assert as_flags(load_config(path)) == flags
    args = cli.parse_args(["--config", str(path), "--model", str(tiny_dir), "--device", "cpu"])
    assert cli.settings_of(cli.build_parser(), args).get("enable-prefix-caching", True) is on
    from stages.generator import parse_args as generator_args
    specs = plan_stages(cli.build_options(args), HostFacts(gpu_count=0))
    generator = generator_args(list(next(s for s in specs if s.role == "generator").args))
    assert generator.enable_prefix_caching is on


def test_mm_processor_kwargs_reach_every_stage_alike_from_the_flag_and_the_file(tiny_dir, tmp_path):
    path = write(tmp_path, 'mm-processor-kwargs: {"max_pixels": 50176}\n')
    for argv in ([str(tiny_dir), "--device", "cpu", "--mm-processor-kwargs", '{"max_pixels": 50176}'],
                 ["--config", str(path), str(tiny_dir), "--device", "cpu"]):
        specs = plan_stages(cli.build_options(cli.parse_args(argv)), HostFacts(gpu_count=0))
        for role in ("proxy", "encoder", "generator"):
            assert '--mm-processor-kwargs={"max_pixels": 50176}' in next(s for s in specs if s.role == role).args
    for value, says in (('{"fps": 2}', "sets only"), ('{"max_pixels": 10}', "max_pixels"), ("[1]", "JSON object")):
        refused = subprocess.run([sys.executable, str(REPO / "bin" / "epd-launch"), str(tiny_dir), "--device", "cpu",
                                  "--mm-processor-kwargs", value], capture_output=True, text=True, timeout=60)
        assert refused.returncode != 0 and says in refused.stderr and len(refused.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("flags, text, eager", [
    (["-O0"], "", True), (["--optimization-level", "3"], "", False), (["-O1", "--enforce-eager"], "", True),
    ([], "optimization-level: 0\n", True), ([], "optimization-level: 2\n", False)])
def test_vllms_optimization_level_zero_is_enforce_eager(tmp_path, tiny_dir, flags, text, eager):
    from stages.generator import parse_args as generator_args

    args = cli.parse_args(["--config", str(write(tmp_path, text or "{}\n")), "--model", str(tiny_dir),
                           "--device", "cpu", *flags])
    specs = plan_stages(cli.build_options(args), HostFacts(gpu_count=0))
    generators = [generator_args(list(s.args)) for s in specs if s.role == "generator"]
    assert generators and all(g.enforce_eager is eager for g in generators)


@pytest.mark.parametrize("value", ["4", '{"level": 3}', ".cudagraph_mode=NONE"])
def test_an_optimization_level_that_is_not_0_to_3_exits_2_in_one_line(value, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.parse_args(["-O", value, "--device", "cpu"])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and len(err.splitlines()) == 1 and "a level of 0, 1, 2 or 3" in err
