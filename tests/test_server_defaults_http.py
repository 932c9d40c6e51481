"""vLLM's server-wide defaults of two response options, through the
proxy's HTTP API against a scripted generator: --enable-force-include-usage
ends every stream with its usage, and --return-tokens-as-token-ids names
logprobs' tokens by id unless a request says otherwise; without them,
neither happens. epd-launch passes both to the proxy."""

from __future__ import annotations

import pytest

from pipeline.launch import cli
from pipeline.launch.plan import HostFacts, plan_stages
from pipeline.processing.processor import Processor
from pipeline.proxy.requests import ModelInfo
from scripted_generator import events, serve_scripted

OUTPUTS = {"hi": "Hello there."}
CHAT = "/v1/chat/completions"


def model_of(tiny_dir, **options) -> ModelInfo:
    return ModelInfo("tiny", Processor.from_checkpoint(tiny_dir, image_token_id=0), 4096, b"salt", **options)


def body(**extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "[hi]"}], **extra}


def usage_chunks(chunks: list[dict]) -> list[dict]:
    return [c["usage"] for c in chunks if not c["choices"] and c.get("usage")]


@pytest.mark.parametrize("forced", [False, True])
def test_force_include_usage_ends_every_stream_with_its_usage(tiny_dir, forced):
    async def scenario(client, generator):
        for options in (None, {"include_usage": False}, {"include_usage": True}):
            extra = {"stream_options": options} if options is not None else {}
            for url, request in ((CHAT, body(stream=True, **extra)),
                                 ("/v1/completions", {"model": "tiny", "prompt": "[hi]", "stream": True, **extra})):
                found = usage_chunks(await events(await client.post(url, json=request)))
                wanted = forced or (options or {}).get("include_usage", False)
                assert len(found) == (1 if wanted else 0), (url, options)
                assert not found or found[0]["completion_tokens"] == len(OUTPUTS["hi"])
        many = usage_chunks(await events(await client.post(CHAT, json=body(stream=True, n=2))))
        assert [u["completion_tokens"] for u in many] == ([2 * len(OUTPUTS["hi"])] if forced else [])

    serve_scripted(model_of(tiny_dir), scenario, OUTPUTS, force_usage=forced)


def test_tokens_as_token_ids_by_default_unless_the_request_says_otherwise(tiny_dir):
    async def scenario(client, generator):
        named = lambda reply: reply["choices"][0]["logprobs"]["content"][0]["token"]   # noqa: E731
        by_default = await (await client.post(CHAT, json=body(logprobs=True))).json()
        assert named(by_default) == "token_id:7"   # the scripted generator's every token is 7
        asked_not = await (await client.post(CHAT, json=body(logprobs=True, return_tokens_as_token_ids=False))).json()
        assert named(asked_not) != "token_id:7"

    serve_scripted(model_of(tiny_dir, tokens_as_ids=True), scenario, OUTPUTS)

    async def plain(client, generator):
        reply = await (await client.post(CHAT, json=body(logprobs=True))).json()
        assert not reply["choices"][0]["logprobs"]["content"][0]["token"].startswith("token_id:")

    serve_scripted(model_of(tiny_dir), plain, OUTPUTS)


def test_epd_launch_passes_both_to_the_proxy(tiny_dir):
    args = cli.parse_args([str(tiny_dir), "--device", "cpu", "--enable-force-include-usage",
                           "--return-tokens-as-token-ids"])
    proxy = next(s for s in plan_stages(cli.build_options(args), HostFacts(gpu_count=0)) if s.role == "proxy")
    from stages.proxy import parse_args as proxy_args
    parsed = proxy_args(list(proxy.args))
    assert parsed.enable_force_include_usage and parsed.return_tokens_as_token_ids
