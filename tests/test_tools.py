"""Tools on the request side: the prompt against transformers' own
apply_chat_template(tools=...) on tool-aware templates in the Qwen (Hermes) format (tests/tool_templates.py), the checks
(400s naming the field), and the grammar of tool_choice "required" and a
named function, walked token by token at random on the tiny tokenizer: every
walk is a call the parser reads whose arguments validate."""

from __future__ import annotations

import asyncio
import json
import random

import jsonschema
import llguidance
import pytest

from pipeline.processing.processor import Processor
from pipeline.proxy.api_types import ApiError, parse_body
from pipeline.proxy.requests import ModelInfo, chat_work, plain_messages
from pipeline.proxy.tool_parser import END, START, parse_tool_calls
from pipeline.proxy.tools import forced_grammar, tag_tokens_of, tool_request
from tool_templates import QWEN3_VL_TOOLS, QWEN25_TOOLS, with_template

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 6},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit"], "additionalProperties": False}
LOOKUP = {"type": "object", "properties": {"words": {"type": "array", "items": {"type": "string", "maxLength": 4},
                                                     "minItems": 1, "maxItems": 2}},
          "required": ["words"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "lookup", "description": "Looks words up.", "parameters": LOOKUP}},
         {"type": "function", "function": {"name": "now"}}]
SCHEMAS = {"get_weather": WEATHER, "lookup": LOOKUP, "now": {"type": "object", "additionalProperties": False}}

# A conversation with earlier calls and their answers, as an API client sends it.
API_MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}},
        {"id": "call_2", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius", "days": 2}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "12 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "3 C"},
    {"role": "assistant", "content": "Paris 12 C, Oslo 3 C. Ünïcode ok."},
    {"role": "user", "content": "Now look up 'fjord'."},
]


def hf_messages() -> list[dict]:
    """The same conversation as a transformers user writes it: the arguments as objects."""
    out = []
    for message in API_MESSAGES:
        message = {k: v for k, v in message.items() if v is not None}
        if "tool_calls" in message:
            message["tool_calls"] = [
                {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                for c in message["tool_calls"]]
        out.append(message)
    return out


@pytest.fixture(scope="module", params=["qwen2.5", "qwen3-vl"])
def tool_dir(request, tiny_dir, tmp_path_factory):
    template = QWEN25_TOOLS if request.param == "qwen2.5" else QWEN3_VL_TOOLS
    return with_template(tiny_dir, tmp_path_factory.mktemp(request.param) / "ckpt", template)


def model_of(path) -> ModelInfo:
    return ModelInfo("tiny", Processor.from_checkpoint(path, image_token_id=0), 4096, b"salt")


def chat_request(**fields):
    return parse_body(json.dumps({"model": "tiny", "max_tokens": 8, **fields}).encode(), "chat")


def work_of(model: ModelInfo, **fields):
    return asyncio.run(chat_work(chat_request(**fields), model, None, "r", "inproc://proxy"))


@pytest.mark.parametrize("tool_choice", [None, "auto", "none", "required"])
def test_the_prompt_is_what_transformers_renders(tool_dir, tool_choice):
    transformers = pytest.importorskip("transformers")
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tool_dir))
    reference = hf_tok.apply_chat_template(hf_messages(), tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert '"arguments": {"city": "Oslo", "unit": "celsius", "days": 2}' in reference
    assert "<tools>\n" + json.dumps(TOOLS[0], ensure_ascii=False) in reference
    req = chat_request(messages=API_MESSAGES, tools=TOOLS, tool_choice=tool_choice)
    model = model_of(tool_dir)
    messages, _ = plain_messages(req.messages)
    assert model.processor.template.render(messages, tools=tool_request(req).template_tools) == reference
    # tool_choice "none" still shows the model its tools, as vLLM does by default.
    work = work_of(model, messages=API_MESSAGES, tools=TOOLS, tool_choice=tool_choice)
    assert list(work.request.prompt_token_ids) == hf_tok.encode(reference, add_special_tokens=False)
    assert (work.request.sampling.grammar != "") == (tool_choice == "required")
    without = hf_tok.apply_chat_template(hf_messages(), tokenize=False, add_generation_prompt=True)
    assert model.processor.template.render(messages) == without and "<tools>" not in without


def test_a_template_without_tools_is_a_400_not_a_prompt_without_them(tiny_dir):
    model = model_of(tiny_dir)
    assert not model.processor.template.reads("tools", tools=True)
    with pytest.raises(ApiError, match="takes no tools") as caught:
        work_of(model, messages=[{"role": "user", "content": "hi"}], tools=TOOLS)
    assert caught.value.param == "tools" and caught.value.status == 400
    with pytest.raises(ApiError, match="tool_calls") as caught:
        work_of(model, messages=API_MESSAGES)
    assert caught.value.param == "messages"
    work_of(model, messages=[{"role": "user", "content": "hi"}], tools=[])   # no tools: nothing to refuse


@pytest.mark.parametrize("fields,param,fragment", [
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice", "not among"),
    (dict(tool_choice="required"), "tool_choice", "needs tools"),
    (dict(tools=TOOLS, tool_choice="always"), "tool_choice", "one of none, auto, required"),
    (dict(tools=TOOLS, tool_choice={"type": "function"}), "tool_choice", "named tool_choice"),
    (dict(tools=[{"type": "retrieval"}]), "tools", r"tools\[0\] must be"),
    (dict(tools=[{"type": "function", "function": {"description": "x"}}]), "tools", "non-empty name"),
    (dict(tools=[TOOLS[0], TOOLS[0]]), "tools", "a second function"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}]), "tools", "JSON schema"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 3}}}],
          tool_choice="required"), "tools", "cannot enforce"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "response_format",
     "already fixes"),
    (dict(messages=[{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{broken"}}]},
        {"role": "user", "content": "x"}]),
     "messages", r"messages\[0\]\.tool_calls\[0\]\.function\.arguments is not valid JSON"),
])
def test_bad_tool_fields_are_400s_naming_the_field(tool_dir, fields, param, fragment):
    fields = {"messages": [{"role": "user", "content": "hi"}], **fields}
    with pytest.raises(ApiError, match=fragment) as caught:
        work_of(model_of(tool_dir), **fields)
    assert caught.value.param == param and caught.value.status == 400


def test_tool_choice_defaults_and_empty_arguments(tool_dir):
    req = chat_request(messages=[{"role": "user", "content": "hi"}], tools=TOOLS)
    assert tool_request(req).choice == "auto" and tool_request(req).parses
    none = tool_request(chat_request(messages=[{"role": "user", "content": "hi"}], tools=TOOLS, tool_choice="none"))
    assert not none.parses and none.template_tools == TOOLS
    assert tool_request(chat_request(messages=[{"role": "user", "content": "x"}], tool_choice="auto")).choice == "none"
    messages, _ = plain_messages(chat_request(messages=[{"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "now", "arguments": ""}}]}]).messages)
    assert messages[0]["tool_calls"] == [{"type": "function", "function": {"name": "now", "arguments": {}}}]


# --- the grammar of a forced tool_choice ---------------------------------------------------------


@pytest.fixture(scope="module")
def walker(tiny_dir):
    """Random walks of a grammar on the tiny tokenizer (which has no <tool_call> token)."""
    processor = Processor.from_checkpoint(tiny_dir, image_token_id=0)
    tokenizer = processor.tokenizer
    ll = llguidance.LLTokenizer((tiny_dir / "tokenizer.json").read_text(), n_vocab=tokenizer.vocab_size)

    def walk(grammar: str, seed: int, limit: int = 600) -> str:
        matcher, rng, out = llguidance.LLMatcher(ll, grammar), random.Random(seed), []
        while not matcher.is_stopped() and len(out) < limit:
            allowed = [i for i, v in enumerate(matcher.compute_logit_bias()) if v]
            out.append(rng.choice(allowed))
            assert matcher.consume_token(out[-1]), matcher.get_error()
        assert matcher.is_stopped() and not matcher.is_error(), tokenizer.decode(out)
        return tokenizer.decode(out)

    walk.ll = ll
    return walk


def forced(tool_choice, parallel=None, tag_tokens=frozenset()) -> str:
    req = chat_request(messages=[{"role": "user", "content": "x"}], tools=TOOLS, tool_choice=tool_choice,
                       parallel_tool_calls=parallel)
    return forced_grammar(tool_request(req), tag_tokens)


@pytest.mark.parametrize("tool_choice,parallel", [("required", None), ("required", False),
                                                  ({"type": "function", "function": {"name": "lookup"}}, None)])
def test_every_walk_of_a_forced_grammar_is_a_valid_call(walker, tool_choice, parallel):
    grammar, counts, names = forced(tool_choice, parallel), set(), set()
    for seed in range(40):
        text = walker(grammar, seed)
        assert text.startswith(START + '\n{"name": "')
        content, calls = parse_tool_calls(text)
        assert content is None and calls, text
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
            # Written with the separators of the templates' tojson, as the model saw its own calls.
            assert call.arguments == json.dumps(json.loads(call.arguments), ensure_ascii=False)
        counts.add(len(calls))
        names |= {call.name for call in calls}
    if isinstance(tool_choice, dict):
        assert names == {"lookup"} and counts == {1}
    elif parallel is False:
        assert counts == {1} and names == set(SCHEMAS)
    else:
        assert max(counts) > 1 and names == set(SCHEMAS)


def test_the_grammar_refuses_free_text(walker, tiny_dir):
    matcher = llguidance.LLMatcher(walker.ll, forced("required"))
    assert not matcher.consume_tokens(Processor.from_checkpoint(tiny_dir, image_token_id=0).tokenizer.encode("Hi"))


def test_where_the_tags_are_tokens_the_grammar_names_those_tokens(tiny_dir, tmp_path):
    """As in Qwen's tokenizers: <tool_call> and </tool_call> are added (not
    special) tokens, which llguidance takes for special ones."""
    from tokenizers import AddedToken, Tokenizer as Backend

    backend = Backend.from_file(str(tiny_dir / "tokenizer.json"))
    backend.add_tokens([AddedToken(tag, special=False, normalized=False) for tag in (START, END)])
    path = with_template(tiny_dir, tmp_path / "tagged", QWEN3_VL_TOOLS)
    backend.save(str(path / "tokenizer.json"))
    tokenizer = Processor.from_checkpoint(path, image_token_id=0).tokenizer
    tags = tag_tokens_of(tokenizer)
    assert tags == {START, END}
    assert tag_tokens_of(Processor.from_checkpoint(tiny_dir, image_token_id=0).tokenizer) == set()
    ll = llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=tokenizer.vocab_size)
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        matcher, rng, out = llguidance.LLMatcher(ll, forced(choice, tag_tokens=tags)), random.Random(3), []
        while not matcher.is_stopped() and len(out) < 600:
            out.append(rng.choice([i for i, v in enumerate(matcher.compute_logit_bias()) if v]))
            assert matcher.consume_token(out[-1]), matcher.get_error()
        assert out[0] == tokenizer.token_id(START) and tokenizer.token_id(END) in out
        content, calls = parse_tool_calls(tokenizer.decode(out))   # the tags are not special: they stay in the text
        assert content is None and calls
        for call in calls:
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_tools_left_out_of_the_prompt_when_tool_choice_is_none_if_the_server_says_so(tool_dir):
    from dataclasses import replace
    transformers = pytest.importorskip("transformers")
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(tool_dir))
    chat = [{"role": "user", "content": "What is the weather in Oslo?"}]
    bare = hf_tok.encode(hf_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True),
                         add_special_tokens=False)
    with_tools = hf_tok.encode(hf_tok.apply_chat_template(chat, tools=TOOLS, tokenize=False,
                                                          add_generation_prompt=True), add_special_tokens=False)
    excluding = replace(model_of(tool_dir), exclude_tools_when_none=True)   # --exclude-tools-when-tool-choice-none
    assert list(work_of(excluding, messages=chat, tools=TOOLS, tool_choice="none").request.prompt_token_ids) == bare
    assert list(work_of(excluding, messages=chat, tools=TOOLS, tool_choice="auto").request.prompt_token_ids) \
        == with_tools
    assert list(work_of(model_of(tool_dir), messages=chat, tools=TOOLS,
                        tool_choice="none").request.prompt_token_ids) == with_tools   # vLLM's default
    with pytest.raises(ApiError, match="a second function"):   # still checked, though left out
        work_of(excluding, messages=chat, tools=[TOOLS[0], TOOLS[0]], tool_choice="none")
