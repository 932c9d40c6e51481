"""--reasoning-parser as a flag: the proxy refuses an unknown parser, or a
model whose tokenizer cannot think, in one line; epd-launch and its config
file pass it to the proxy. So with --default-chat-template-kwargs, which
must be a JSON object that sets none of the request's own fields."""

from __future__ import annotations

import subprocess
import sys
import typing

import pytest

from conftest import REPO
from pipeline.launch import cli
from pipeline.launch.config import ConfigError, ReasoningParser, load_config
from pipeline.launch.plan import HostFacts, plan_stages
from pipeline.proxy.reasoning import PARSERS


def proxy_flags_of(args) -> list[str]:
    specs = plan_stages(cli.build_options(args), HostFacts(gpu_count=0))
    return list(next(s for s in specs if s.role == "proxy").args)


def run_proxy(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stages.proxy", "--mode", "aggregated", "--generators",
                           "ipc:///tmp/nowhere.sock", *flags], capture_output=True, text=True, timeout=60, cwd=REPO)


def test_an_unknown_parser_exits_2_and_a_model_that_cannot_think_exits_1_in_one_line(tiny_dir):
    result = run_proxy("--reasoning-parser", "granite")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "--reasoning-parser" in lines[0], result.stderr
    result = run_proxy("--model", str(tiny_dir), "--reasoning-parser", "qwen3")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert lines[0] == ("stages.proxy: error: --reasoning-parser qwen3: this model's tokenizer has no <think> or "
                        "</think> token; it is not a thinking model")


def test_epd_launch_and_its_config_file_pass_the_parser_to_the_proxy(tiny_dir, tmp_path):
    args = cli.parse_args([str(tiny_dir), "--device", "cpu", "--reasoning-parser", "deepseek_r1"])
    assert "--reasoning-parser=deepseek_r1" in proxy_flags_of(args)
    assert not any("reasoning" in flag for flag in proxy_flags_of(cli.parse_args([str(tiny_dir), "--device", "cpu"])))
    path = tmp_path / "epd.yaml"
    path.write_text("reasoning-parser: qwen3\n")
    args = cli.parse_args(["--config", str(path), str(tiny_dir), "--device", "cpu"])
    assert "--reasoning-parser=qwen3" in proxy_flags_of(args)
    path.write_text("reasoning_parser: granite\n")
    with pytest.raises(ConfigError, match="allowed: deepseek_r1, qwen3"):
        load_config(path)


def test_the_config_schema_names_the_proxys_parsers():
    assert typing.get_args(ReasoningParser) == PARSERS


def test_default_template_variables_are_a_json_object_passed_to_the_proxy(tiny_dir, tmp_path):
    args = cli.parse_args([str(tiny_dir), "--device", "cpu", "--default-chat-template-kwargs",
                           '{"enable_thinking": false}'])
    assert '--default-chat-template-kwargs={"enable_thinking": false}' in proxy_flags_of(args)
    from stages.proxy import parse_args as proxy_args
    assert proxy_args([*proxy_flags_of(args)]).default_chat_template_kwargs == {"enable_thinking": False}
    path = tmp_path / "epd.yaml"
    path.write_text("default-chat-template-kwargs: {enable_thinking: true, effort: 2}\n")
    args = cli.parse_args(["--config", str(path), str(tiny_dir), "--device", "cpu"])
    assert '--default-chat-template-kwargs={"enable_thinking": true, "effort": 2}' in proxy_flags_of(args)
    for bad, says in (("[1]", "expected a JSON object"), ('{"tools": []}', "may not set tools")):
        result = run_proxy("--default-chat-template-kwargs", bad)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and says in lines[0], result.stderr
