"""Tool calls through the served stack (openai SDK) on the tiny random model,
whose free text is gibberish, behind a tool-aware chat template in the Qwen (Hermes) format:
with tool_choice "required" or a named function the grammar makes every
answer a tool call whose arguments validate against the tool's parameters,
streamed and not, beside an image, with logprobs and with n > 1."""

from __future__ import annotations

import json

import jsonschema
import pytest

from e2e_helpers import IMAGES, chat_messages, client, serving
from stack import Stack
from pipeline.proxy.tool_parser import START
from tool_templates import QWEN3_VL_TOOLS, with_template

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 8},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit"], "additionalProperties": False}
TAGS = {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                  "minItems": 1, "maxItems": 3},
                                         "score": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["tags"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "tag_image", "description": "Tags the picture.",
                                           "parameters": TAGS}}]
SCHEMAS = {"get_weather": WEATHER, "tag_image": TAGS}
NAMED = {"type": "function", "function": {"name": "tag_image"}}


@pytest.fixture(scope="module")
def served(tiny_dir, tmp_path_factory):
    model = with_template(tiny_dir, tmp_path_factory.mktemp("tools-model") / "ckpt", QWEN3_VL_TOOLS)
    yield from serving(Stack(tmp_path_factory.mktemp("tools-e2e"), model, encoders=1, generators=1))


def ask(stack, stream=False, images=0, **fields):
    """(content, [(name, arguments)], finish reason, usage, the whole choice or the chunks)."""
    kwargs = {"model": "tiny", "messages": chat_messages(IMAGES[images], "What now?"), "tools": TOOLS,
              "max_tokens": 200, "temperature": 0, **fields}
    if not stream:
        reply = client(stack).chat.completions.create(**kwargs)
        choice = reply.choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()]
        return choice.message.content, calls, choice.finish_reason, reply.usage, choice
    content, calls, reason, usage, chunks = "", {}, None, None, []
    for chunk in client(stack).chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        chunks.append(chunk)
        usage = chunk.usage or usage
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or ():
            if call.id:
                calls[call.index] = [call.function.name, ""]
            calls[call.index][1] += call.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    return content or None, [tuple(calls[i]) for i in sorted(calls)], reason, usage, chunks


def check_calls(calls, names=set(SCHEMAS)):
    assert calls
    for name, arguments in calls:
        assert name in names
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


@pytest.mark.parametrize("images", [0, 1])
@pytest.mark.parametrize("tool_choice,parallel", [("required", False), (NAMED, None)])
def test_a_forced_tool_choice_is_a_valid_call_streamed_and_not(served, tool_choice, parallel, images):
    fields = {"tool_choice": tool_choice}
    if parallel is not None:
        fields["parallel_tool_calls"] = parallel
    content, calls, reason, usage, _ = ask(served, images=images, **fields)
    assert content is None and reason == "tool_calls" and len(calls) == 1
    check_calls(calls, {"tag_image"} if tool_choice == NAMED else set(SCHEMAS))
    streamed = ask(served, stream=True, images=images, **fields)
    assert streamed[:3] == (content, calls, reason)   # greedy: the same answer, added up from the deltas
    assert streamed[3].completion_tokens == usage.completion_tokens


def test_required_with_parallel_calls(served):
    content, calls, reason, usage, _ = ask(served, tool_choice="required", max_tokens=400)
    streamed = ask(served, stream=True, tool_choice="required", max_tokens=400)
    check_calls(calls)
    if reason == "tool_calls":
        assert content is None and streamed[:3] == (content, calls, reason)
        return
    # The random model went on calling until max_tokens cut a call; whole,
    # that block is content as written.
    assert reason == "length" and usage.completion_tokens == 400
    assert content.lstrip().startswith(START + '\n{"name": ')
    if streamed[1][:-1] == calls and len(streamed[1]) == len(calls) + 1:
        # Cut inside its arguments: streamed, it is the call sent so far.
        assert streamed[0] is None and streamed[2] == "length"
        assert content.lstrip().endswith(streamed[1][-1][1])
    else:
        # Cut before its arguments began: it never became a call, streamed or not.
        assert streamed[:3] == (content, calls, reason)


def test_logprobs_usage_and_n_beside_a_forced_call(served):
    reply = client(served).chat.completions.create(
        model="tiny", messages=chat_messages([], "Tag it."), tools=TOOLS, tool_choice=NAMED, max_tokens=200,
        temperature=1.0, seed=7, n=2, logprobs=True, top_logprobs=2)
    assert [c.index for c in reply.choices] == [0, 1]
    total = 0
    for choice in reply.choices:
        assert choice.finish_reason == "tool_calls"
        check_calls([(c.function.name, c.function.arguments) for c in choice.message.tool_calls], {"tag_image"})
        assert all(len(entry.top_logprobs) == 2 for entry in choice.logprobs.content)
        total += len(choice.logprobs.content)
    assert reply.usage.completion_tokens == total


def test_auto_and_none_answer_without_error(served):
    # The random model never writes the tags on its own: its gibberish is content.
    for tool_choice in ("auto", "none"):
        content, calls, reason, _, _ = ask(served, tool_choice=tool_choice, max_tokens=24)
        assert calls == [] and reason in ("stop", "length") and isinstance(content, str)
