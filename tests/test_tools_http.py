"""Tool calls through the proxy's HTTP API in-process: a scripted generator
(real sockets, the generator's side of the protocol) answers each request
with a crafted model output cut into deltas, and the answers, whole and
streamed, carry the calls in the OpenAI shapes; n > 1, logprobs and usage
keep working beside them."""

from __future__ import annotations

import pytest

from pipeline.processing.processor import Processor
from pipeline.proxy.requests import ModelInfo
from pipeline.proxy.tool_parser import END, START
from scripted_generator import events, serve_scripted
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


@pytest.fixture(scope="module")
def model(tiny_dir, tmp_path_factory):
    path = with_template(tiny_dir, tmp_path_factory.mktemp("tools-http") / "ckpt", QWEN3_VL_TOOLS)
    return ModelInfo("tiny", Processor.from_checkpoint(path, image_token_id=0), 4096, b"salt")


def serve(model, scenario, piece=1):
    serve_scripted(model, scenario, OUTPUTS, piece)


def body(word: str, **extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": f"[{word}]"}], "tools": TOOLS, **extra}


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
