"""Structured output through the served stack (openai SDK) on the tiny
random model, whose free text is gibberish: every answer under a JSON
schema parses and validates, for five schemas (nested objects, arrays,
enums, numbers, required fields), streamed and not, in EPD and aggregated
mode; bad schemas are 400s; the bitmask unpacking is exact."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
import torch

from e2e_helpers import client, serving
from pipeline.engine.grammar import unpack_bitmask
from stack import Stack

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8},
        "owner": {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}},
                  "required": ["age"], "additionalProperties": False}},
        "required": ["name", "owner"], "additionalProperties": False},
    "array": {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "minItems": 1, "maxItems": 3}},
        "required": ["tags"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
             "required": ["colour", "ok"], "additionalProperties": False},
    "numbers": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9},
                                                 "m": {"type": "integer", "minimum": -50, "maximum": 50}},
                "required": ["n", "m"], "additionalProperties": False},
    "list": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 50}, "minItems": 2, "maxItems": 4},
}


def test_unpack_bitmask():
    words = torch.tensor([[0b101, -1], [0, -(1 << 31)]], dtype=torch.int32)   # -(1 << 31): bit 31 alone
    allowed = unpack_bitmask(words, 40)
    assert allowed[0].nonzero().flatten().tolist() == [0, 2, *range(32, 40)]
    assert allowed[1].nonzero().flatten().tolist() == []   # bit 31 of word 1 is token 63, past the vocabulary


@pytest.fixture(scope="module", params=["epd", "aggregated"])
def served(request, tiny_dir, tmp_path_factory):
    layout = dict(encoders=1, generators=1) if request.param == "epd" else dict(encoders=0, generators=1,
                                                                                  aggregated=True)
    yield from serving(Stack(tmp_path_factory.mktemp(f"structured-{request.param}"), tiny_dir, **layout))


def ask(stack, response_format, stream=False) -> tuple[str, str]:
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "Answer in JSON."}], max_tokens=120,
                  temperature=0, response_format=response_format)
    if not stream:
        choice = client(stack).chat.completions.create(**kwargs).choices[0]
        return choice.message.content, choice.finish_reason
    text, reason = "", None
    for chunk in client(stack).chat.completions.create(**kwargs, stream=True):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
    return text, reason


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_answers_follow_their_schema(served, name):
    fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name]}}
    whole, reason = ask(served, fmt)
    assert reason == "stop", whole
    jsonschema.validate(json.loads(whole), SCHEMAS[name])
    streamed, _ = ask(served, fmt, stream=True)
    assert streamed == whole


def test_json_object_and_bad_schemas(served):
    # Any object: the random model may write one key for ever, so only a
    # finished answer must parse; a cut one is still an object's beginning.
    text, reason = ask(served, {"type": "json_object"})
    assert text.startswith("{")
    if reason == "stop":
        assert isinstance(json.loads(text), dict)
    for fmt, fragment in (({"type": "json_schema", "json_schema": {"name": "x"}}, "json_schema.schema"),
                          ({"type": "yaml"}, "not one of"),
                          ({"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": 3}}},
                           "JSON schema")):
        with pytest.raises(openai.BadRequestError, match=fragment):
            ask(served, fmt)
    # The common servers' guided_json, as an extra field.
    reply = client(served).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=60, temperature=0,
        extra_body={"guided_json": SCHEMAS["enum"]})
    jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMAS["enum"])


def test_vllm_structured_outputs_regex_choice_and_grammar(served):
    """vLLM's `structured_outputs` (and its older `guided_*` names) as extra
    fields, on chat and on text completions."""
    import re

    def chat(extra, stream=False):
        kwargs = dict(model="tiny", messages=[{"role": "user", "content": "Answer."}], max_tokens=40,
                      temperature=0, extra_body=extra)
        if not stream:
            choice = client(served).chat.completions.create(**kwargs).choices[0]
            return choice.message.content, choice.finish_reason
        chunks = list(client(served).chat.completions.create(**kwargs, stream=True))
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), None

    pattern = r"\d{3}-[a-z]{2,4}"
    text, reason = chat({"structured_outputs": {"regex": pattern}})
    assert re.fullmatch(pattern, text) and reason == "stop", text
    assert chat({"structured_outputs": {"regex": pattern}}, stream=True)[0] == text
    assert re.fullmatch(pattern, chat({"guided_regex": pattern})[0])
    choices = ["positive", "negative", "neutral (unsure)"]
    assert chat({"structured_outputs": {"choice": choices}})[0] in choices
    assert chat({"guided_choice": choices})[0] in choices
    gbnf = 'root ::= answer | answer "," answer\nanswer ::= "yes" | "no"'
    text, reason = chat({"structured_outputs": {"grammar": gbnf}})
    assert re.fullmatch(r"(yes|no)(,(yes|no))?", text) and reason == "stop", text
    completion = client(served).completions.create(model="tiny", prompt="Pick:", max_tokens=20, temperature=0,
                                                   extra_body={"structured_outputs": {"choice": choices}})
    assert completion.choices[0].text in choices
    with pytest.raises(openai.BadRequestError, match="exactly one"):
        chat({"structured_outputs": {"regex": "a", "choice": ["b"]}})
