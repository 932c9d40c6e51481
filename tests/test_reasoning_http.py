"""--reasoning-parser through the proxy's HTTP API, against a scripted
generator: whole and streamed chat answers carry the reasoning apart from
the content (in `reasoning`, and `reasoning_content` for older clients), the
tool calls are parsed from the content alone, include_reasoning false drops
it, a grammar reaches the generator wrapped so that it holds the content
alone, and a server with no parser, or a text completion, is as before.
/tokenize renders chats with the same template variables."""

from __future__ import annotations

import json

import pytest

from pipeline.processing.processor import Processor
from pipeline.proxy.reasoning import reasoning_parser
from pipeline.proxy.requests import ModelInfo
from scripted_generator import events, serve_scripted
from thinking_model import with_thinking

CHAT = "/v1/chat/completions"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
OUTPUTS = {
    "plain": "<think>\nThe user greets me.\n</think>\n\nHello!",
    "cut": "<think>\nStill thinking about it",
    "tool": "<think>I need the weather: <tool_call> in thought is no call.</think>\n\n" + CALL,
    "closed": "Just an answer, with a </think> in it.",
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def make_model(folder, parser: str | None) -> ModelInfo:
    processor = Processor.from_checkpoint(folder, image_token_id=0)
    return ModelInfo("tiny", processor, 4096, b"salt", reasoning=reasoning_parser(parser, processor.tokenizer))


@pytest.fixture(scope="module")
def folder(tiny_dir, tmp_path_factory):
    return with_thinking(tiny_dir, tmp_path_factory.mktemp("reasoning-http") / "ckpt")


@pytest.fixture(scope="module")
def model(folder):
    return make_model(folder, "qwen3")


def body(word: str, **extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": f"[{word}]"}], **extra}


def add_up(chunks: list[dict]) -> dict:
    """A streamed choice as a client adds it up."""
    out = {"reasoning": "", "reasoning_content": "", "content": "", "tool_calls": 0, "finish_reason": None}
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            assert delta.get("reasoning") == delta.get("reasoning_content")
            for key in ("reasoning", "reasoning_content", "content"):
                out[key] += delta.get(key) or ""
            out["tool_calls"] += sum(1 for call in delta.get("tool_calls", ()) if "id" in call)
            out["finish_reason"] = choice["finish_reason"] or out["finish_reason"]
    return out


async def both(client, word: str, **fields) -> tuple[dict, dict]:
    """(the whole answer's message and finish reason, the streamed answer added up)."""
    whole = (await (await client.post(CHAT, json=body(word, **fields))).json())["choices"][0]
    chunks = await events(await client.post(CHAT, json=body(word, stream=True, **fields)))
    return {**whole["message"], "finish_reason": whole["finish_reason"]}, add_up(chunks)


@pytest.mark.parametrize("piece", [1, 3, 100])
def test_the_reasoning_comes_apart_from_the_content_whole_and_streamed(model, piece):
    async def scenario(client, generator):
        whole, streamed = await both(client, "plain")
        assert whole == {"role": "assistant", "content": "\n\nHello!", "reasoning": "\nThe user greets me.\n",
                         "reasoning_content": "\nThe user greets me.\n", "finish_reason": "stop"}
        assert streamed == {"reasoning": whole["reasoning"], "reasoning_content": whole["reasoning"],
                            "content": whole["content"], "tool_calls": 0, "finish_reason": "stop"}
        whole, streamed = await both(client, "cut")   # cut off while thinking: all reasoning
        assert (whole["reasoning"], whole["content"]) == ("\nStill thinking about it", None)
        assert (streamed["reasoning"], streamed["content"]) == ("\nStill thinking about it", "")

    serve_scripted(model, scenario, OUTPUTS, piece)


def test_tool_calls_come_from_the_content_alone(model):
    async def scenario(client, generator):
        whole, streamed = await both(client, "tool", tools=TOOLS)
        assert whole["reasoning"] == "I need the weather: <tool_call> in thought is no call."
        assert whole["content"] is None and len(whole["tool_calls"]) == 1
        assert json.loads(whole["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
        assert whole["finish_reason"] == streamed["finish_reason"] == "tool_calls"
        assert (streamed["reasoning"], streamed["tool_calls"]) == (whole["reasoning"], 1)

    serve_scripted(model, scenario, OUTPUTS, piece=2)


def test_include_reasoning_false_and_a_prompt_that_closed_the_reasoning(model):
    async def scenario(client, generator):
        whole, streamed = await both(client, "plain", include_reasoning=False)
        assert whole == {"role": "assistant", "content": "\n\nHello!", "finish_reason": "stop"}
        assert (streamed["reasoning"], streamed["content"]) == ("", "\n\nHello!")
        # Thinking off: the template closes the reasoning in the prompt, and all the answer is content.
        off = {"chat_template_kwargs": {"enable_thinking": False}}
        whole, streamed = await both(client, "closed", **off)
        assert (whole["reasoning"], whole["content"]) == (None, OUTPUTS["closed"])
        assert (streamed["reasoning"], streamed["content"]) == ("", OUTPUTS["closed"])

    serve_scripted(model, scenario, OUTPUTS, piece=4)


def test_a_grammar_reaches_the_generator_free_until_the_reasoning_ends(model):
    end = model.reasoning.end_id

    async def scenario(client, generator):
        fields = {"response_format": {"type": "json_object"}}
        await both(client, "plain", **fields)
        await both(client, "closed", chat_template_kwargs={"enable_thinking": False}, **fields)
        await both(client, "tool", tools=TOOLS, tool_choice="required")
        open_, _, closed, _, forced, _ = (r.sampling.grammar for r in generator.requests)
        assert json.loads(open_)["grammars"][0]["lark_grammar"] == f"start: <[^{end}]>* (<[{end}]> @json_schema)?"
        assert "<[" not in closed and json.loads(closed)["grammars"][0]["name"] == "json_schema"
        assert json.loads(forced)["grammars"][1]["lark_grammar"].startswith('start: call ("\\n" call)*')

    serve_scripted(model, scenario, OUTPUTS, piece=5)


def test_without_a_parser_and_in_text_completions_nothing_is_split(folder, model):
    async def scenario(client, generator):
        whole, streamed = await both(client, "plain")
        assert whole == {"role": "assistant", "content": OUTPUTS["plain"], "finish_reason": "stop"}
        assert (streamed["reasoning"], streamed["content"]) == ("", OUTPUTS["plain"])

    serve_scripted(make_model(folder, None), scenario, OUTPUTS, piece=3)

    async def completion(client, generator):
        reply = await (await client.post("/v1/completions", json={"model": "tiny", "prompt": "[plain]"})).json()
        assert reply["choices"][0]["text"] == OUTPUTS["plain"] and "reasoning" not in reply["choices"][0]

    serve_scripted(model, completion, OUTPUTS)


def test_tokenize_renders_with_the_same_template_variables_as_chat(model):
    async def scenario(client, generator):
        off = {"chat_template_kwargs": {"enable_thinking": False}}
        await both(client, "plain", **off)
        shown = await (await client.post("/tokenize", json={**body("plain", **off), "return_token_strs": True})).json()
        assert shown["tokens"] == list(generator.requests[0].prompt_token_ids)
        assert shown["token_strs"][-6:] == ["<think>", "Ċ", "Ċ", "</think>", "Ċ", "Ċ"]   # byte-level names
        plain = await (await client.post("/tokenize", json=body("plain"))).json()
        assert "token_strs" not in plain and len(plain["tokens"]) < len(shown["tokens"])
        refused = await client.post("/tokenize", json={**body("plain"), "chat_template_kwargs": {"tools": []}})
        assert refused.status == 400 and "chat_template_kwargs may not set tools" in (await refused.text())

    serve_scripted(model, scenario, OUTPUTS)


def test_the_servers_default_template_variables_yield_to_the_requests(folder):
    processor = Processor.from_checkpoint(folder, image_token_id=0)
    quiet = ModelInfo("tiny", processor, 4096, b"salt", reasoning=reasoning_parser("qwen3", processor.tokenizer),
                      template_kwargs={"enable_thinking": False})

    async def scenario(client, generator):
        whole, _ = await both(client, "closed")   # the server's default: thinking off, all content
        assert (whole["reasoning"], whole["content"]) == (None, OUTPUTS["closed"])
        whole, _ = await both(client, "plain", chat_template_kwargs={"enable_thinking": True})
        assert (whole["reasoning"], whole["content"]) == ("\nThe user greets me.\n", "\n\nHello!")
        prompts = [processor.tokenizer.decode(r.prompt_token_ids) for r in generator.requests]
        assert prompts[0].endswith("</think>\n\n") and not prompts[2].endswith("</think>\n\n")

    serve_scripted(quiet, scenario, OUTPUTS)


def test_reasoning_effort_sets_the_template_variables_under_the_requests_own(folder):
    """OpenAI's reasoning_effort, as the Responses API takes reasoning.effort:
    none turns thinking off, any other effort on (over the server's default);
    the request's chat_template_kwargs still have the last word."""
    processor = Processor.from_checkpoint(folder, image_token_id=0)
    quiet = ModelInfo("tiny", processor, 4096, b"salt", reasoning=reasoning_parser("qwen3", processor.tokenizer),
                      template_kwargs={"enable_thinking": False})

    async def scenario(client, generator):
        whole, streamed = await both(client, "plain", reasoning_effort="high")
        assert (whole["reasoning"], whole["content"]) == ("\nThe user greets me.\n", "\n\nHello!")
        assert streamed["reasoning"] == whole["reasoning"]
        whole, _ = await both(client, "closed", reasoning_effort="none")
        assert (whole["reasoning"], whole["content"]) == (None, OUTPUTS["closed"])
        whole, _ = await both(client, "closed", reasoning_effort="high",
                              chat_template_kwargs={"enable_thinking": False})
        assert (whole["reasoning"], whole["content"]) == (None, OUTPUTS["closed"])
        prompts = [processor.tokenizer.decode(r.prompt_token_ids) for r in generator.requests]
        assert not prompts[0].endswith("</think>\n\n") and prompts[2].endswith("</think>\n\n")
        assert prompts[4].endswith("</think>\n\n")
        refused = await client.post(CHAT, json=body("plain", reasoning_effort="max"))
        assert refused.status == 400 and (await refused.json())["error"]["param"] == "reasoning_effort"

    serve_scripted(quiet, scenario, OUTPUTS)
