"""The Responses API (`/v1/responses`) through the proxy's HTTP API, against a
scripted generator: the response object and its output items whole, the
same answer as events when streamed, the input items as the prompt the
generator gets, stored responses (previous_response_id, GET, DELETE, the
bound), tools, reasoning, logprobs, a length cut, and a 400 or 404 naming
what is wrong."""

from __future__ import annotations

import json

import pytest

from pipeline.processing.processor import Processor
from pipeline.proxy.reasoning import reasoning_parser
from pipeline.proxy.requests import ModelInfo
from scripted_generator import FAILURE, serve_scripted
from thinking_model import with_thinking
from tool_templates import QWEN3_VL_TOOLS, with_template

URL = "/v1/responses"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
OUTPUTS = {
    "hello": "Hello there.",
    "again": "Once more.",
    "tool": "Let me look. " + CALL,
    "think": "<think>\nThe user greets me.\n</think>\n\nHi!",
    "long": ("Cut off in the mid", "length"),
    "fails": ("Half an ans", "error"),
}
TOOLS = [{"type": "function", "name": "get_weather", "description": "the weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


@pytest.fixture(scope="module")
def model(tiny_dir, tmp_path_factory):
    """The tiny checkpoint with Qwen3-VL's tool-aware template (tool calls and their answers)."""
    path = with_template(tiny_dir, tmp_path_factory.mktemp("responses-http") / "ckpt", QWEN3_VL_TOOLS)
    return ModelInfo("tiny", Processor.from_checkpoint(path, image_token_id=0), 4096, b"salt")


@pytest.fixture(scope="module")
def thinking(tiny_dir, tmp_path_factory):
    folder = with_thinking(tiny_dir, tmp_path_factory.mktemp("responses-thinking") / "ckpt")
    processor = Processor.from_checkpoint(folder, image_token_id=0)
    return ModelInfo("tiny", processor, 4096, b"salt", reasoning=reasoning_parser("qwen3", processor.tokenizer))


def serve(model, scenario, piece: int = 2, **options):
    serve_scripted(model, scenario, OUTPUTS, piece=piece, **options)


async def create(client, status: int = 200, **body) -> dict:
    response = await client.post(URL, json={"model": "tiny", **body})
    reply = await response.json()
    assert response.status == status, reply
    return reply


async def stream(client, **body) -> list[dict]:
    """A streamed response's events, after checking each one's SSE name."""
    response = await client.post(URL, json={"model": "tiny", "stream": True, **body})
    assert response.status == 200 and response.headers["Content-Type"].startswith("text/event-stream")
    out = []
    for block in (await response.text()).strip().split("\n\n"):
        name, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == "event: " + event["type"]
        out.append(event)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def prompt_of(model, generator) -> str:
    return model.processor.tokenizer.decode(generator.requests[-1].prompt_token_ids)


def texts(output: list[dict]) -> list[tuple[str, str]]:
    """(type, text) of each output item."""
    def text(item):
        if item["type"] == "function_call":
            return item["name"] + item["arguments"]
        return "".join(part["text"] for part in item["content"])
    return [(item["type"], text(item)) for item in output]


def test_a_text_input_gets_a_response_object_with_one_message(model):
    async def scenario(client, generator):
        reply = await create(client, input="[hello]", max_output_tokens=50, metadata={"k": "v"})
        assert reply["id"].startswith("resp_") and reply["object"] == "response"
        assert (reply["status"], reply["model"], reply["incomplete_details"], reply["error"]) == (
            "completed", "tiny", None, None)
        assert texts(reply["output"]) == [("message", "Hello there.")]
        message = reply["output"][0]
        assert (message["role"], message["status"], message["content"][0]["type"]) == (
            "assistant", "completed", "output_text")
        assert (reply["max_output_tokens"], reply["metadata"], reply["store"]) == (50, {"k": "v"}, True)
        usage = reply["usage"]
        assert usage["input_tokens"] == len(generator.requests[-1].prompt_token_ids) > 0
        assert usage["output_tokens"] == 6 and usage["total_tokens"] == usage["input_tokens"] + 6
        assert usage["output_tokens_details"] == {"reasoning_tokens": 0}
        assert generator.requests[-1].sampling.max_tokens == 50
    serve(model, scenario)


@pytest.mark.parametrize("piece", [1, 5, 100])
def test_a_streamed_response_adds_up_to_the_whole_one(model, piece):
    async def scenario(client, generator):
        whole = await create(client, input="[tool]", tools=TOOLS)
        events = await stream(client, input="[tool]", tools=TOOLS)
        kinds = [e["type"] for e in events]
        assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
        assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
        deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        arguments = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
        done = events[-1]["response"]
        assert texts(done["output"]) == texts(whole["output"]) == [
            ("message", "Let me look. "), ("function_call", 'get_weather{"city": "Paris"}')]
        assert (deltas, arguments) == ("Let me look. ", '{"city": "Paris"}')
        assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [0, 1]
        assert [e["item"]["id"] for e in events if e["type"] == "response.output_item.done"] == [
            item["id"] for item in done["output"]]
        assert done["usage"]["output_tokens"] == whole["usage"]["output_tokens"]
    serve(model, scenario, piece=piece)


def test_input_items_become_the_conversation_the_prompt_renders(model):
    async def scenario(client, generator):
        await create(client, instructions="Be brief.", input=[
            {"role": "developer", "content": "Answer in English."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "[again] first"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "An answer."}]},
            {"role": "user", "content": "second"}])
        prompt = prompt_of(model, generator)
        order = [prompt.index(s) for s in ("Be brief.", "Answer in English.", "first", "An answer.", "second")]
        assert order == sorted(order)
        assert "developer" not in prompt   # a system turn, as the templates know
    serve(model, scenario)


def test_previous_response_id_goes_on_from_the_stored_answer(model):
    async def scenario(client, generator):
        first = await create(client, instructions="Old rules.", input="[hello] my name is Ada")
        stored = await (await client.get(f"{URL}/{first['id']}")).json()
        assert stored == first
        second = await create(client, input="[again] what is my name?", previous_response_id=first["id"],
                              instructions="New rules.")
        prompt = prompt_of(model, generator)
        order = [prompt.index(s) for s in ("New rules.", "my name is Ada", "Hello there.", "what is my name?")]
        assert order == sorted(order) and "Old rules." not in prompt
        assert second["previous_response_id"] == first["id"]
        await create(client, input="[again] and now?", previous_response_id=second["id"])
        third = prompt_of(model, generator)   # the script answers by the first word it knows: [hello] again
        assert third.count("Hello there.") == 2 and third.index("what is my name?") < third.index("and now?")
        deleted = await (await client.delete(f"{URL}/{first['id']}")).json()
        assert deleted == {"id": first["id"], "object": "response", "deleted": True}
        assert (await client.get(f"{URL}/{first['id']}")).status == 404
        gone = await create(client, 404, input="[again]", previous_response_id=first["id"])
        assert gone["error"]["param"] == "previous_response_id" and first["id"] in gone["error"]["message"]
    serve(model, scenario)


def test_store_false_keeps_nothing_and_a_server_without_a_store_says_so(model):
    async def unstored(client, generator):
        reply = await create(client, input="[hello]", store=False)
        assert reply["store"] is False
        assert (await client.get(f"{URL}/{reply['id']}")).status == 404
        await create(client, 404, input="[again]", previous_response_id=reply["id"])
        cancel = await client.post(f"{URL}/{reply['id']}/cancel")
        assert cancel.status == 404
    serve(model, unstored)

    async def no_store(client, generator):
        assert (await create(client, input="[hello]"))["store"] is False
        events = await stream(client, input="[hello]")
        assert events[0]["response"]["store"] is False and events[-1]["response"]["store"] is False
    serve(model, no_store, responses_store_bytes=0)


def test_a_stored_response_cannot_be_cancelled_and_get_does_not_stream(model):
    async def scenario(client, generator):
        reply = await create(client, input="[hello]")
        cancel = await client.post(f"{URL}/{reply['id']}/cancel")
        assert cancel.status == 400 and "synchronous" in (await cancel.json())["error"]["message"]
        assert (await client.get(f"{URL}/{reply['id']}?stream=true")).status == 400
    serve(model, scenario)


def test_a_streamed_response_is_stored_as_the_whole_one_would_be(model):
    async def scenario(client, generator):
        events = await stream(client, input="[hello]")
        done = events[-1]["response"]
        assert done["store"] is True
        assert await (await client.get(f"{URL}/{done['id']}")).json() == done
        await create(client, input="[again]", previous_response_id=done["id"])
        assert "Hello there." in prompt_of(model, generator)
    serve(model, scenario)


def test_tool_calls_are_function_call_items_and_their_outputs_go_back_in(model):
    async def scenario(client, generator):
        reply = await create(client, input="[tool] weather?", tools=TOOLS)
        call = reply["output"][1]
        assert (call["type"], call["name"], json.loads(call["arguments"]), call["status"]) == (
            "function_call", "get_weather", {"city": "Paris"}, "completed")
        assert call["call_id"].startswith("call_") and call["id"].startswith("fc_")
        assert reply["tools"] == TOOLS and reply["tool_choice"] == "auto"
        await create(client, tools=TOOLS, previous_response_id=reply["id"], input=[
            {"type": "function_call_output", "call_id": call["call_id"], "output": "[again] 21 C"}])
        prompt = prompt_of(model, generator)
        assert "get_weather" in prompt and "<tool_response>" in prompt and "21 C" in prompt
        assert prompt.index("<tool_call>") < prompt.index("21 C")
        await create(client, tools=TOOLS, previous_response_id=reply["id"], input=[
            {"type": "function_call_output", "call_id": call["call_id"],
             "output": [{"type": "input_text", "text": "[again] 21"}, {"type": "input_text", "text": " C"}]}])
        assert prompt_of(model, generator) == prompt   # an output in parts reads as its text
        # The same conversation sent whole, the call as an input item: the same prompt.
        await create(client, tools=TOOLS, input=[
            {"role": "user", "content": "[tool] weather?"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look. "}]},
            {"type": "function_call", "call_id": call["call_id"], "name": "get_weather", "arguments": call["arguments"]},
            {"type": "function_call_output", "call_id": call["call_id"], "output": "[again] 21 C"}])
        assert prompt_of(model, generator) == prompt
    serve(model, scenario)


def test_a_forced_tool_and_a_json_schema_reach_the_generator_as_grammars(model):
    async def scenario(client, generator):
        await create(client, input="[hello]")
        assert generator.requests[-1].sampling.grammar == ""
        await create(client, input="[tool]", tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"})
        assert "get_weather" in generator.requests[-1].sampling.grammar
        schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
        reply = await create(client, input="[hello]", text={"format": {"type": "json_schema", "name": "a",
                                                                       "schema": schema}})
        assert "answer" in generator.requests[-1].sampling.grammar
        assert reply["text"]["format"] == {"type": "json_schema", "name": "a", "schema": schema}
    serve(model, scenario)


def test_a_length_cut_is_an_incomplete_response(model):
    async def scenario(client, generator):
        reply = await create(client, input="[long]", max_output_tokens=9)
        assert (reply["status"], reply["incomplete_details"]) == ("incomplete", {"reason": "max_output_tokens"})
        events = await stream(client, input="[long]", max_output_tokens=9)
        assert events[-1]["type"] == "response.completed" and events[-1]["response"]["status"] == "incomplete"
    serve(model, scenario)


def test_a_failure_partway_ends_the_stream_with_response_failed_and_nothing_is_stored(model):
    async def scenario(client, generator):
        whole = await create(client, 500, input="[fails]")
        assert whole["error"]["message"] == FAILURE
        events = await stream(client, input="[fails]")
        kinds = [e["type"] for e in events]
        assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.failed"
        assert "response.completed" not in kinds
        assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Half an ans"
        failed = events[-1]["response"]
        assert failed["status"] == "failed" and failed["error"] == {"code": "server_error", "message": FAILURE}
        assert texts(failed["output"]) == [("message", "Half an ans")]   # what was written, closed
        assert failed["output"][0]["status"] == "incomplete" and kinds[-2] == "response.output_item.done"
        assert (await client.get(f"{URL}/{failed['id']}")).status == 404
        assert len(generator.requests) == 2   # a failure is an answer: nothing was sent again
        assert texts((await create(client, input="[hello]"))["output"]) == [("message", "Hello there.")]
    serve(model, scenario)


def test_logprobs_ride_on_the_output_text(model):
    async def scenario(client, generator):
        include = ["message.output_text.logprobs"]
        reply = await create(client, input="[hello]", include=include, top_logprobs=1)
        entries = reply["output"][0]["content"][0]["logprobs"]
        assert len(entries) == reply["usage"]["output_tokens"] == 6
        assert entries[0]["logprob"] == -0.5 and len(entries[0]["top_logprobs"]) == 1
        assert generator.requests[-1].sampling.logprobs == 1
        events = await stream(client, input="[hello]", include=include, top_logprobs=1)
        streamed = [x for e in events if e["type"] == "response.output_text.delta" for x in e["logprobs"]]
        assert streamed == entries == next(e for e in events if e["type"] == "response.output_text.done")["logprobs"]
        assert "logprobs" not in (await create(client, input="[hello]"))["output"][0]["content"][0]
    serve(model, scenario)


def test_a_thinking_model_answers_with_a_reasoning_item(thinking):
    async def scenario(client, generator):
        whole = await create(client, input="[think]")
        assert texts(whole["output"]) == [("reasoning", "\nThe user greets me.\n"), ("message", "\n\nHi!")]
        assert whole["output"][0]["summary"] == []
        events = await stream(client, input="[think]")
        reasoning = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
        assert reasoning == "\nThe user greets me.\n"
        assert texts(events[-1]["response"]["output"]) == texts(whole["output"])
        # Every scripted token is id 7, never </think>: all of them count as reasoning.
        assert whole["usage"]["output_tokens_details"]["reasoning_tokens"] == whole["usage"]["output_tokens"]
        off = await create(client, input="[think]", reasoning={"effort": "none"})
        assert [kind for kind, _ in texts(off["output"])] == ["message"] and off["reasoning"]["effort"] == "none"
        assert off["usage"]["output_tokens_details"]["reasoning_tokens"] == 0
    serve(thinking, scenario)


@pytest.mark.parametrize("body, param", [
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": "x", "background": True, "store": False}, "background"),
    ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [
        {"type": "input_image", "image_url": "data:,"}]}]}, "input"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "truncation": "sometimes"}, "truncation"),
    ({"input": "x", "service_tier": "flex"}, "service_tier"),
    ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text"),
    ({"input": "x", "reasoning": {"effort": "extreme"}}, "reasoning"),
    ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"input": "x", "prompt": {"id": "p"}}, "prompt"),
])
def test_what_is_not_served_is_a_400_naming_it(model, body, param):
    async def scenario(client, generator):
        reply = await create(client, 400, **body)
        assert reply["error"]["param"] == param, reply
        assert not generator.requests
    serve(model, scenario)


def test_a_model_not_served_is_a_404(model):
    async def scenario(client, generator):
        response = await client.post(URL, json={"model": "other", "input": "x"})
        assert response.status == 404
    serve(model, scenario)
