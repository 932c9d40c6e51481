"""Tool calls through the proxy's HTTP API in-process: a scripted generator
(real sockets, the generator's side of the protocol) answers each request
with a crafted model output cut into deltas, and the answers, whole and
streamed, carry the calls in the OpenAI shapes; n > 1, logprobs and usage
keep working beside them."""

from __future__ import annotations

import asyncio
import json

import pytest
import zmq.asyncio
from aiohttp.test_utils import TestClient, TestServer

from pipeline import protocol, transport
from pipeline.processing.processor import Processor
from pipeline.proxy.dispatcher import Dispatcher
from pipeline.proxy.media_fetch import FetchPolicy
from pipeline.proxy.requests import ModelInfo
from pipeline.proxy.server import ProxyApp
from pipeline.proxy.tool_parser import END, START
from tool_templates import QWEN3_VL_TOOLS, with_template

CHAT = "/v1/chat/completions"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CALL = f'{START}\n{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}\n{END}'
# What the "model" writes, by a word of the user's message.
OUTPUTS = {
    "one": "Let me look.\n" + CALL,
    "two": CALL + "\n" + CALL.replace("Paris", "Oslo"),
    "broken": f"{START}\n{{not json}}\n{END} sorry",
    "plain": "No tools needed.",
}


class ScriptedGenerator:
    """Answers stats requests, and each generate request with the output its
    prompt names, one delta per `piece` characters."""

    def __init__(self, ctx, address: str, tokenizer, piece: int) -> None:
        self.address, self.tokenizer, self.piece = address, tokenizer, piece
        self.inbox, self.outbox = transport.Inbox(ctx, address), transport.Outbox(ctx)
        self.requests: list[protocol.GenerateRequest] = []

    def start(self) -> None:
        self.inbox.listen(self.on_message)

    def on_message(self, message) -> None:
        if isinstance(message, protocol.StatsRequest):
            self.outbox.try_send(message.reply_to, protocol.StageStats("generator", "g", {}, {}, self.address, "one"))
        elif isinstance(message, protocol.GenerateRequest):
            self.requests.append(message)
            asyncio.get_running_loop().create_task(self.answer(message))

    async def answer(self, request: protocol.GenerateRequest) -> None:
        prompt = self.tokenizer.decode(request.prompt_token_ids)
        text = next(out for key, out in OUTPUTS.items() if f"[{key}]" in prompt)
        pieces = [text[i:i + self.piece] for i in range(0, len(text), self.piece)]
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            logprobs = ((-0.5, (7,), (-0.5,)),) if request.sampling.logprobs is not None else ()
            self.outbox.try_send(request.reply_to, protocol.TokenDelta(
                request.request_id, (7,), piece, last, "stop" if last else "", len(request.prompt_token_ids),
                i + 1, logprobs=logprobs))
            await asyncio.sleep(0)

    def close(self) -> None:
        self.inbox.close()
        self.outbox.close()


@pytest.fixture(scope="module")
def model(tiny_dir, tmp_path_factory):
    path = with_template(tiny_dir, tmp_path_factory.mktemp("tools-http") / "ckpt", QWEN3_VL_TOOLS)
    return ModelInfo("tiny", Processor.from_checkpoint(path, image_token_id=0), 4096, b"salt")


def serve(model, scenario, piece=1):
    async def run():
        ctx = zmq.asyncio.Context()
        generator = ScriptedGenerator(ctx, "inproc://tools-gen", model.processor.tokenizer, piece)
        generator.start()
        dispatcher = Dispatcher(ctx, "inproc://tools-proxy", [], [generator.address], aggregated=True,
                                ping_interval=0.05)
        try:
            async with TestClient(TestServer(ProxyApp(dispatcher, model, FetchPolicy()).build())) as client:
                while (await client.get("/health")).status != 200:
                    await asyncio.sleep(0.02)
                await scenario(client, generator)
        finally:
            generator.close()
            ctx.term()

    asyncio.run(run())


def body(word: str, **extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": f"[{word}]"}], "tools": TOOLS, **extra}


async def events(response) -> list[dict]:
    text = await response.text()
    assert text.endswith("data: [DONE]\n\n")
    return [json.loads(line[6:]) for line in text.split("\n\n") if line.startswith("data: {")]


def add_up(chunks: list[dict], index: int = 0) -> tuple[str | None, list[dict], str]:
    """A streamed choice as a client adds it up: (content, calls, finish reason)."""
    content, calls, reason = "", {}, None
    for chunk in chunks:
        for choice in chunk["choices"]:
            if choice["index"] != index:
                continue
            delta = choice["delta"]
            content += delta.get("content") or ""
            for call in delta.get("tool_calls", ()):
                if "id" in call:
                    assert call["type"] == "function" and call["id"].startswith("call_")
                    calls[call["index"]] = {"id": call["id"], "type": "function",
                                            "function": {"name": call["function"]["name"], "arguments": ""}}
                calls[call["index"]]["function"]["arguments"] += call["function"].get("arguments", "")
            reason = choice["finish_reason"] or reason
    return content or None, [calls[i] for i in sorted(calls)], reason


def without_ids(calls: list[dict]) -> list[dict]:
    return [{**c, "id": None} for c in calls]


def test_whole_and_streamed_answers_carry_the_calls(model):
    async def scenario(client, generator):
        for word, content, arguments in (("one", "Let me look.\n", ['{"city": "Paris"}']),
                                         ("two", None, ['{"city": "Paris"}', '{"city": "Oslo"}'])):
            whole = await (await client.post(CHAT, json=body(word))).json()
            choice = whole["choices"][0]
            assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == content
            calls = choice["message"]["tool_calls"]
            assert [c["function"]["arguments"] for c in calls] == arguments
            assert {c["function"]["name"] for c in calls} == {"get_weather"}
            assert len({c["id"] for c in calls}) == len(calls)
            assert whole["usage"]["completion_tokens"] == len(OUTPUTS[word])   # one "token" per character
            chunks = await events(await client.post(CHAT, json=body(word, stream=True,
                                                                     stream_options={"include_usage": True})))
            assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
            assert not any(START in (c["choices"][0]["delta"].get("content") or "") for c in chunks if c["choices"])
            streamed_content, streamed_calls, reason = add_up([c for c in chunks if c["choices"]])
            assert (streamed_content, without_ids(streamed_calls), reason) == (content, without_ids(calls),
                                                                                  "tool_calls")
            assert chunks[-1]["usage"]["completion_tokens"] == len(OUTPUTS[word])

    serve(model, scenario)


def test_what_is_not_a_call_stays_content(model):
    async def scenario(client, generator):
        for word, fields in (("broken", {}), ("plain", {}), ("one", {"tool_choice": "none"})):
            whole = await (await client.post(CHAT, json=body(word, **fields))).json()
            message = whole["choices"][0]["message"]
            assert message == {"role": "assistant", "content": OUTPUTS[word]} and whole["choices"][0][
                "finish_reason"] == "stop"
            chunks = await events(await client.post(CHAT, json=body(word, stream=True, **fields)))
            assert add_up(chunks) == (OUTPUTS[word], [], "stop")
        assert all(not r.sampling.grammar for r in generator.requests)

    serve(model, scenario, piece=3)


def test_n_choices_and_logprobs_beside_tool_calls(model):
    def tokens(word: str) -> int:   # one "token" per delta of two characters
        return (len(OUTPUTS[word]) + 1) // 2

    async def scenario(client, generator):
        whole = await (await client.post(CHAT, json=body("two", n=2, logprobs=True, top_logprobs=1))).json()
        assert [c["index"] for c in whole["choices"]] == [0, 1]
        for choice in whole["choices"]:
            assert [c["function"]["arguments"] for c in choice["message"]["tool_calls"]] == [
                '{"city": "Paris"}', '{"city": "Oslo"}']
            assert len(choice["logprobs"]["content"]) == tokens("two")
        assert whole["usage"]["completion_tokens"] == 2 * tokens("two")
        chunks = await events(await client.post(CHAT, json=body("one", n=2, stream=True, logprobs=True)))
        for index in (0, 1):
            content, calls, reason = add_up(chunks, index)
            assert content == "Let me look.\n" and reason == "tool_calls"
            assert [c["function"]["arguments"] for c in calls] == ['{"city": "Paris"}']
        with_logprobs = [c for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
        assert sum(len(c["choices"][0]["logprobs"]["content"]) for c in with_logprobs) == 2 * tokens("one")

    serve(model, scenario, piece=2)


def test_a_forced_choice_sends_its_grammar_and_bad_fields_are_400s_and_tokenize_takes_tools(model):
    async def scenario(client, generator):
        named = {"type": "function", "function": {"name": "get_weather"}}
        for choice in ("required", named):
            reply = await (await client.post(CHAT, json=body("one", tool_choice=choice))).json()
            assert reply["choices"][0]["finish_reason"] == "tool_calls"
        required, named_one = (r.sampling.grammar for r in generator.requests)
        assert required.startswith('start: call ("\\n" call)*\n') and named_one.startswith("start: call\n")
        bad = await client.post(CHAT, json=body("one", tool_choice={"type": "function", "function": {"name": "x"}}))
        assert bad.status == 400 and (await bad.json())["error"]["param"] == "tool_choice"
        completion = await client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "tools": TOOLS})
        assert completion.status == 400 and (await completion.json())["error"]["param"] == "tools"
        # /tokenize renders the tools too: the same ids as the chat's prompt.
        tokens = await (await client.post("/tokenize", json={"messages": body("one")["messages"],
                                                              "tools": TOOLS})).json()
        assert tokens["tokens"] == list(generator.requests[-1].prompt_token_ids)

    serve(model, scenario)
