"""vLLM's --max-logprobs: the most top logprobs a request may ask for, 20
by default (the OpenAI API's cap), -1 for the whole vocabulary. The proxy
refuses more with a 400 naming the flag, a generator checks again in vLLM's
words, epd-launch and its config file pass it to both, and a served stack
given 30 answers with 25. And vllm serve's --block-size, which epd-launch
passes to the generators."""

from __future__ import annotations

import httpx
import pytest
import torch

from e2e_helpers import serving
from pipeline.engine.engine import Engine, EngineConfig
from pipeline.launch import cli
from pipeline.launch.plan import HostFacts, plan_stages
from pipeline.models.loader import load_model
from pipeline.processing.processor import Processor
from pipeline.proxy.api_types import ApiError, ChatCompletionRequest, CompletionRequest
from pipeline.proxy.sampling_fields import processor_fields
from pipeline.sampling_params import SamplingParams, max_logprobs_of
from stack import Stack


def test_the_cap_is_20_by_default_and_minus_one_is_the_vocabulary():
    assert max_logprobs_of(20, 462) == 20 and max_logprobs_of(-1, 462) == 462 and max_logprobs_of(0, 462) == 0
    with pytest.raises(ValueError, match="-1"):
        max_logprobs_of(-2, 462)


def test_the_proxy_refuses_more_than_the_cap_naming_the_flag():
    chat = ChatCompletionRequest(messages=[], logprobs=True, top_logprobs=25)
    with pytest.raises(ApiError, match=r"must be in \[0, 20\], got 25$"):
        processor_fields(chat, 462)
    assert processor_fields(chat, 462, max_logprobs=30)["logprobs"] == 25
    with pytest.raises(ApiError, match=r"\[0, 24\], got 25 \(the server's --max-logprobs\)"):
        processor_fields(chat, 462, max_logprobs=24)
    prompt = CompletionRequest(prompt="x", prompt_logprobs=25)
    assert processor_fields(prompt, 462, max_logprobs=30)["prompt_logprobs"] == 25
    with pytest.raises(ApiError, match=r"prompt_logprobs must be in \[0, 20\]"):
        processor_fields(prompt, 462)


def test_the_engine_checks_again_and_gives_as_many_as_asked(tiny_dir):
    loaded = load_model(tiny_dir)
    processor = Processor.from_checkpoint(tiny_dir, loaded.config.image_token_id)
    prompt = processor.chat_prompt([{"role": "user", "content": "Hello"}], [])
    engine = Engine(loaded.model, processor.tokenizer, EngineConfig(kv_cache_bytes=8 << 20), torch.device("cpu"))
    with pytest.raises(ValueError, match="Requested sample logprobs of 21, which is greater than max allowed: 20"):
        engine.add_request("many", prompt, [], SamplingParams(max_tokens=2, logprobs=21))
    with pytest.raises(ValueError, match="Requested prompt logprobs of 21"):
        engine.add_request("many", prompt, [], SamplingParams(max_tokens=2, prompt_logprobs=21))
    wide = Engine(loaded.model, processor.tokenizer, EngineConfig(kv_cache_bytes=8 << 20, max_logprobs=30),
                  torch.device("cpu"))
    wide.add_request("many", prompt, [], SamplingParams(max_tokens=2, logprobs=25, ignore_eos=True))
    entries = []
    while wide.has_work():
        for out in wide.step():
            entries += out.logprobs
    assert len(entries) == 2 and all(len(ids) == len(values) == 25 for _, ids, values in entries)
    assert all(list(values) == sorted(values, reverse=True) for _, _, values in entries)


def stage_flags(args, role: str) -> list[str]:
    specs = plan_stages(cli.build_options(args), HostFacts(gpu_count=0))
    return [flag for s in specs if s.role == role for flag in s.args]


def test_epd_launch_and_its_config_file_pass_the_cap_to_the_generators_and_the_proxy(tiny_dir, tmp_path):
    args = cli.parse_args([str(tiny_dir), "--device", "cpu", "--max-logprobs", "-1"])
    assert "--max-logprobs=-1" in stage_flags(args, "generator") and "--max-logprobs=-1" in stage_flags(args, "proxy")
    path = tmp_path / "epd.yaml"
    path.write_text("max-logprobs: 30\n")
    args = cli.parse_args(["--config", str(path), str(tiny_dir), "--device", "cpu"])
    assert "--max-logprobs=30" in stage_flags(args, "generator") and "--max-logprobs=30" in stage_flags(args, "proxy")
    with pytest.raises(SystemExit) as exit_:
        cli.parse_args([str(tiny_dir), "--device", "cpu", "--max-logprobs", "-2"])
    assert exit_.value.code == 2


@pytest.fixture(scope="module")
def served(tiny_dir, tmp_path_factory):
    cap = ("--max-logprobs", "30")
    yield from serving(Stack(tmp_path_factory.mktemp("max-logprobs"), tiny_dir, encoders=0, generators=1,
                             aggregated=True, generator_args=cap, proxy_args=cap))


def test_a_stack_given_30_answers_25_and_refuses_31(served):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3, "temperature": 0,
            "logprobs": True, "top_logprobs": 25}
    reply = httpx.post(served.base_url + "/v1/chat/completions", json=body, timeout=60).json()
    content = reply["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(len(entry["top_logprobs"]) == 25 for entry in content)
    assert all(entry["top_logprobs"][0]["logprob"] == entry["logprob"] for entry in content)   # greedy
    refused = httpx.post(served.base_url + "/v1/chat/completions", json={**body, "top_logprobs": 31}, timeout=60)
    assert refused.status_code == 400 and "--max-logprobs" in refused.json()["error"]["message"]


def test_epd_launch_passes_vllms_block_sizes_to_the_generators(tiny_dir, tmp_path):
    args = cli.parse_args([str(tiny_dir), "--device", "cpu", "--block-size", "32"])
    assert "--block-size=32" in stage_flags(args, "generator") and not any(
        "block" in flag for flag in stage_flags(args, "proxy"))
    path = tmp_path / "epd.yaml"
    path.write_text("block-size: 8\n")
    assert "--block-size=8" in stage_flags(cli.parse_args(["--config", str(path), str(tiny_dir), "--device", "cpu"]),
                                           "generator")
    with pytest.raises(SystemExit) as exit_:
        cli.parse_args([str(tiny_dir), "--device", "cpu", "--block-size", "24"])
    assert exit_.value.code == 2
