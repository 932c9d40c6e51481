"""The rest of vllm serve's common flags on epd-launch: those whose meaning
holds here are accepted and change no stage's command line; those for what
is not served exit 2 in one line saying why; those that hold at one value
refuse another; and the ones acted on reach their stages: the KV cache's
bytes, CORS, /load, human-readable sizes, and a repo id's --revision in a
--download-dir cache."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys

import pytest

from conftest import REPO
from pipeline.launch import cli
from pipeline.launch.config import load_config
from pipeline.launch.plan import HostFacts, plan_stages
from pipeline.launch.vllm_other_flags import ACCEPTED, ONE, REFUSED, SWITCH
from pipeline.processing.processor import Processor
from pipeline.proxy.requests import ModelInfo
from scripted_generator import serve_scripted


def stage_args(args) -> dict[str, list[str]]:
    specs = plan_stages(cli.build_options(args), HostFacts(gpu_count=0))
    return {spec.instance: list(spec.args) for spec in specs}


def flag_argv(flag: str, takes) -> list[str]:
    return [flag] if takes == SWITCH else [flag, "1"] if takes == ONE else [flag, "a", "b"]


def launch(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "bin" / "epd-launch"), *argv, "--device", "cpu"],
                          capture_output=True, text=True, timeout=60)


def test_an_accepted_flag_changes_no_stage(tiny_dir):
    plain = stage_args(cli.parse_args([str(tiny_dir), "--device", "cpu"]))
    argv = [str(tiny_dir), "--device", "cpu"]
    for flag, takes, _ in ACCEPTED:
        argv += flag_argv(flag, takes)
    assert stage_args(cli.parse_args(argv)) == plain


@pytest.mark.parametrize("flag, takes", [(flag, takes) for flag, takes, _ in REFUSED])
def test_a_flag_for_what_is_not_served_exits_2_saying_why(tiny_dir, flag, takes, capsys):
    with pytest.raises(SystemExit) as caught:
        cli.parse_args([str(tiny_dir), "--device", "cpu", *flag_argv(flag, takes)])
    err = capsys.readouterr().err
    assert caught.value.code == 2 and err.count("\n") == 1 and f"error: {flag}: not served here: " in err


@pytest.mark.parametrize("flag, good, bad", [
    ("--cpu-offload-gb", "0", "4.0"), ("--api-server-count", "1", "2"), ("--tokenizer-mode", "hf", "mistral"),
    ("--model-impl", "auto", "transformers"), ("--logprobs-mode", "raw_logprobs", "processed_logprobs"),
    ("--response-role", "assistant", "bot"), ("--guided-decoding-backend", "guidance", "xgrammar"),
    ("--prefix-caching-hash-algo", "xxhash", "sha256"), ("--max-num-partial-prefills", "1", "4"),
    ("--long-prefill-token-threshold", "0", "256"),
])
def test_a_flag_that_holds_at_one_value_refuses_another(tiny_dir, flag, good, bad, capsys):
    cli.parse_args([str(tiny_dir), "--device", "cpu", flag, good])
    with pytest.raises(SystemExit):
        cli.parse_args([str(tiny_dir), "--device", "cpu", flag, bad])
    assert f"{flag} {bad}: " in capsys.readouterr().err


def test_sizes_read_as_vllm_reads_them_and_the_kv_cache_bytes_reach_the_generators(tiny_dir, capsys):
    args = cli.parse_args([str(tiny_dir), "--device", "cpu", "--kv-cache-memory-bytes", "2G", "--max-model-len",
                           "2k", "--max-num-batched-tokens", "4K"])
    stages = stage_args(args)
    generator = next(a for name, a in stages.items() if name.startswith("generator"))
    assert "--kv-cache-mib=2048" in generator and "--max-model-len=2000" in generator
    assert "--max-num-batched-tokens=4096" in generator and "--max-model-len=2000" in stages["proxy"]
    from stages.generator import parse_args as generator_args
    assert generator_args(generator).kv_cache_mib == 2048
    for bad in ("512k", "lots"):
        with pytest.raises(SystemExit):
            cli.parse_args([str(tiny_dir), "--device", "cpu", "--kv-cache-memory-bytes", bad])
    assert "--kv-cache-memory-bytes" in capsys.readouterr().err


def test_cors_and_load_tracking_reach_the_proxy_also_from_a_config_file(tiny_dir, tmp_path):
    path = tmp_path / "epd.yaml"
    path.write_text("allowed-methods: [GET, POST]\nallowed-headers: [X-A]\nallow-credentials: true\n"
                    "enable-server-load-tracking: true\nswap-space: 4\nstructured-outputs-config: {backend: guidance}\n"
                    "exclude-tools-when-tool-choice-none: true\n")
    load_config(path)
    proxy = stage_args(cli.parse_args(["--config", str(path), str(tiny_dir), "--device", "cpu"]))["proxy"]
    from stages.proxy import parse_args as proxy_args
    parsed = proxy_args(proxy)
    assert (parsed.allowed_methods, parsed.allowed_headers) == (["GET", "POST"], ["X-A"])
    assert parsed.allow_credentials and parsed.enable_server_load_tracking
    assert parsed.exclude_tools_when_tool_choice_none
    result = launch(str(tiny_dir), "--allowed-methods", "GET")
    assert result.returncode == 2 and "JSON list" in result.stderr
    result = launch(str(tiny_dir), "--structured-outputs-config", '{"backend": "xgrammar"}')
    assert result.returncode == 2 and "llguidance" in result.stderr


def test_load_counts_the_generation_requests_in_flight(tiny_dir):
    model = ModelInfo("tiny", Processor.from_checkpoint(tiny_dir, image_token_id=0), 4096, b"salt")

    async def scenario(client, generator):
        assert await (await client.get("/load")).json() == {"server_load": 0}
        body = {"model": "tiny", "messages": [{"role": "user", "content": "[wait]"}]}
        pending = asyncio.ensure_future(client.post("/v1/chat/completions", json=body))
        deadline = asyncio.get_running_loop().time() + 10
        while not generator.requests:
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.01)
        assert await (await client.get("/load")).json() == {"server_load": 1}
        await client.get("/health")   # not a generation request
        generator.release.set()
        assert (await pending).status == 200
        assert await (await client.get("/load")).json() == {"server_load": 0}

    serve_scripted(model, scenario, {"wait": ("Done.", "held")}, load_tracking=True)

    async def untracked(client, generator):
        generator.release.set()
        await client.post("/v1/chat/completions", json={"model": "tiny", "messages": [
            {"role": "user", "content": "[wait]"}]})
        assert await (await client.get("/load")).json() == {"server_load": 0}

    serve_scripted(model, untracked, {"wait": ("Done.", "held")})


def test_a_repo_id_is_found_at_its_revision_in_the_download_dir(tiny_dir, tmp_path, capsys):
    repo = tmp_path / "cache" / "models--acme--tiny-vl"
    for commit, ref in (("0123abcd", "main"), ("4567ef01", "v2")):
        shutil.copytree(tiny_dir, repo / "snapshots" / commit)
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    cache = str(tmp_path / "cache")
    assert cli.parse_args(["acme/tiny-vl", "--download-dir", cache]).model == repo / "snapshots" / "0123abcd"
    at_v2 = cli.parse_args(["acme/tiny-vl", "--download-dir", cache, "--revision", "v2"])
    assert at_v2.model == repo / "snapshots" / "4567ef01"
    with pytest.raises(SystemExit):
        cli.parse_args(["acme/tiny-vl", "--download-dir", cache, "--revision", "v3"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "revision 'v3'" in err and cache in err
