"""The structured output forms clients send, compiled in the proxy: vLLM's
`structured_outputs` (json, regex, choice, grammar, json_object and the
JSON options) and its older `guided_*` fields. Each compiled grammar is
checked on the tiny model's tokenizer: the strings it must take, and one it
must not. Conflicts and bad constraints are 400s naming the field."""

from __future__ import annotations

import json

import llguidance
import pytest

from pipeline.proxy.api_types import ApiError, parse_body
from pipeline.proxy.structured import grammar_of


def grammar(**fields) -> str:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], **fields}
    return grammar_of(parse_body(json.dumps(body).encode(), "chat"))


def refused(**fields) -> ApiError:
    with pytest.raises(ApiError) as caught:
        grammar(**fields)
    assert caught.value.status == 400
    return caught.value


@pytest.fixture(scope="module")
def takes(tiny_dir):
    tokenizer = llguidance.LLTokenizer((tiny_dir / "tokenizer.json").read_text())

    def whole(text: str, compiled: str) -> bool:
        """Whether the grammar takes exactly `text` as a whole answer."""
        matcher = llguidance.LLMatcher(tokenizer, compiled, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        ids = tokenizer.tokenize_str(text)
        return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()
    return whole


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_each_form_compiles_to_the_constraint_it_names(takes):
    for compiled in (grammar(structured_outputs={"regex": r"\d{3}-[a-z]+"}), grammar(guided_regex=r"\d{3}-[a-z]+")):
        assert takes("123-abc", compiled) and not takes("12-abc", compiled)
    choices = ['say "yes"', "naïve\n", "x|y", "1.5*"]   # quotes, non-ASCII, and regex metacharacters
    for compiled in (grammar(structured_outputs={"choice": choices}), grammar(guided_choice=choices)):
        assert all(takes(c, compiled) for c in choices) and not takes("x", compiled) and not takes("naive\n", compiled)
    gbnf = 'root ::= answer ("," answer)*\nanswer ::= "yes" | "no"'
    lark = 'start: answer ("," answer)*\nanswer: "yes" | "no"'
    for compiled in (grammar(structured_outputs={"grammar": gbnf}), grammar(structured_outputs={"grammar": lark}),
                     grammar(guided_grammar=gbnf)):
        assert takes("yes,no,no", compiled) and not takes("yes,", compiled) and not takes("maybe", compiled)
    compiled = grammar(structured_outputs={"json_object": True})
    assert takes('{"k":[1]}', compiled) and not takes("[1]", compiled)


def test_json_is_compact_unless_a_whitespace_pattern_is_given_and_objects_close_on_request(takes):
    for compiled in (grammar(structured_outputs={"json": SCHEMA}), grammar(guided_json=SCHEMA),
                     grammar(structured_outputs={"json": json.dumps(SCHEMA), "disable_any_whitespace": True})):
        assert takes('{"a":1}', compiled) and not takes('{"a": 1}', compiled)
        assert takes('{"a":1,"b":2}', compiled)   # the schema does not close the object
    for compiled in (grammar(structured_outputs={"json": SCHEMA, "whitespace_pattern": "[ ]?"}),
                     grammar(guided_json=SCHEMA, guided_whitespace_pattern="[ ]?")):
        assert takes('{"a": 1}', compiled) and not takes('{"a":\n1}', compiled)
    closed = grammar(structured_outputs={"json": SCHEMA, "disable_additional_properties": True})
    assert takes('{"a":1}', closed) and not takes('{"a":1,"b":2}', closed)
    # A schema that says it takes other keys keeps them; so does data that looks like a schema.
    open_schema = {**SCHEMA, "additionalProperties": True,
                   "properties": {"a": {"enum": [{"properties": {}}, 1]}}}
    kept = grammar(structured_outputs={"json": open_schema, "disable_additional_properties": True})
    assert takes('{"a":{"properties":{}},"b":2}', kept)


@pytest.mark.parametrize("fields, param, says", [
    (dict(structured_outputs={"regex": "a", "choice": ["b"]}), "structured_outputs", "exactly one"),
    (dict(structured_outputs={}), "structured_outputs", "got none"),
    (dict(structured_outputs={"structural_tag": "{}"}), "structured_outputs", "structural_tag"),
    (dict(structured_outputs={"regex": "(a"}), "structured_outputs", "unclosed group"),
    (dict(structured_outputs={"grammar": "root ::= (("}), "structured_outputs", "grammar"),
    (dict(structured_outputs={"grammar": "start: missing"}), "structured_outputs", "unknown name"),
    (dict(structured_outputs={"choice": []}), "structured_outputs", "non-empty"),
    (dict(structured_outputs={"regex": "a", "whitespace_pattern": " "}), "structured_outputs", "JSON schema only"),
    (dict(structured_outputs={"json": {}, "whitespace_pattern": " ", "disable_any_whitespace": True}),
     "structured_outputs", "contradict"),
    (dict(structured_outputs={"json": "{not json"}), "structured_outputs", "not valid JSON"),
    (dict(guided_regex="a", response_format={"type": "json_object"}), "guided_regex", "response_format and guided_regex"),
    (dict(guided_choice=["a"], structured_outputs={"regex": "a"}), "guided_choice", "not structured_outputs"),
    (dict(guided_whitespace_pattern=" "), "guided_whitespace_pattern", "guided_json only"),
    (dict(guided_json={"type": "object", "properties": 3}), "guided_json", "JSON schema"),
])
def test_conflicts_and_bad_constraints_are_400s_naming_the_field(fields, param, says):
    error = refused(**fields)
    assert error.param == param and says in str(error), str(error)


def test_a_misspelt_option_or_a_wrong_type_is_a_400():
    for fields, where in ((dict(structured_outputs={"regx": "a"}), "regx"),
                          (dict(structured_outputs={"choice": [1]}), "choice"),
                          (dict(guided_choice="a"), "guided_choice")):
        assert where in str(refused(**fields))


def test_a_forced_tool_choice_takes_no_other_constraint():
    body = {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required",
            "structured_outputs": {"regex": "a"}}
    with pytest.raises(ApiError, match="already fixes") as caught:
        grammar_of(parse_body(json.dumps(body).encode(), "chat"), tool_grammar="forced")
    assert caught.value.param == "structured_outputs"
