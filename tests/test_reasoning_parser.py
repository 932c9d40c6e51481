"""The reasoning parsers (pipeline/proxy/reasoning.py): how an answer splits
into reasoning and content, whole and streamed (any cut of the text streams
to the whole answer's split), when the prompt has already closed the
reasoning, and the grammar that leaves the reasoning free."""

from __future__ import annotations

import json

import llguidance
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.processing.tokenizer import Tokenizer
from pipeline.proxy.reasoning import ReasoningSplit, ReasoningStream, grammar_after_reasoning, reasoning_parser
from thinking_model import with_thinking


@pytest.fixture(scope="module")
def tokenizer(tiny_dir, tmp_path_factory):
    return Tokenizer.from_checkpoint(with_thinking(tiny_dir, tmp_path_factory.mktemp("thinking") / "ckpt"))


@pytest.fixture(scope="module")
def qwen3(tokenizer):
    return reasoning_parser("qwen3", tokenizer)


def test_an_unknown_parser_or_a_model_that_cannot_think_is_refused_in_one_line(tiny_dir, tokenizer):
    with pytest.raises(ValueError, match="want one of deepseek_r1, qwen3"):
        reasoning_parser("granite", tokenizer)
    with pytest.raises(ValueError, match=r"no <think> or </think> token; it is not a thinking model"):
        reasoning_parser("qwen3", Tokenizer.from_checkpoint(tiny_dir))
    assert reasoning_parser(None, tokenizer) is None


def test_the_think_tokens_are_single_tokens_that_stay_in_the_text(tokenizer, qwen3):
    ids = tokenizer.encode("<think>a</think>b")
    assert ids[0] == qwen3.start_id and qwen3.end_id in ids
    assert tokenizer.decode(ids) == "<think>a</think>b"
    assert qwen3.start_id not in qwen3.special_ids and tokenizer.token_id("<|im_start|>") in qwen3.special_ids


@pytest.mark.parametrize("prompt,closed", [
    ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n", True),
    ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n", False),
    ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", False),
    # An earlier turn's closed reasoning does not close this turn's.
    ("<|im_start|>assistant\n<think>x</think>y<|im_end|>\n<|im_start|>assistant\n", False),
    # The final message continued (continue_final_message) after its reasoning.
    ("<|im_start|>assistant\n<think>x</think>partial answer", True),
])
def test_a_prompt_closes_the_reasoning_only_in_its_own_turn(tokenizer, qwen3, prompt, closed):
    assert qwen3.for_request(tokenizer.encode(prompt), None).prompt_closed is closed


def test_thinking_off_is_qwen3s_alone(tokenizer, qwen3):
    ids = tokenizer.encode("<|im_start|>assistant\n")
    off = {"enable_thinking": False}
    assert qwen3.for_request(ids, off).all_content
    assert not reasoning_parser("deepseek_r1", tokenizer).for_request(ids, off).all_content
    assert not qwen3.for_request(ids, {"enable_thinking": True}).all_content


SPLITS = [
    ("<think>\nplan</think>\n\nanswer", ("\nplan", "\n\nanswer")),
    ("plan</think>answer", ("plan", "answer")),
    ("  <think>plan</think>", ("plan", None)),
    ("plan, cut off", ("plan, cut off", None)),
    ("a</think>b</think>c", ("a", "b</think>c")),
    ("</think>", ("", None)),
    ("x<think>y</think>z", ("x<think>y", "z")),
    ("", ("", None)),
]


@pytest.mark.parametrize("text,expected", SPLITS)
def test_a_whole_answer_splits_at_the_first_end_tag(text, expected):
    assert ReasoningSplit(0).split(text) == expected


def test_an_answer_after_a_closed_prompt_is_all_content():
    assert ReasoningSplit(0, prompt_closed=True).split("a</think>b") == (None, "a</think>b")
    assert ReasoningSplit(0, thinking_off=True).split("plan") == (None, "plan")


def stream(split: ReasoningSplit, pieces: list[str]) -> tuple[str, str, list[tuple[str, str]]]:
    parser = ReasoningStream(split)
    out = [parser.feed(piece, i == len(pieces) - 1) for i, piece in enumerate(pieces)]
    return "".join(r for r, _ in out), "".join(c for _, c in out), out


def test_a_stream_holds_back_only_what_may_be_a_tag():
    _, _, out = stream(ReasoningSplit(0), ["<th", "ink>", "pl", "an</", "thi", "nk>", "ans", "wer"])
    assert out == [("", ""), ("", ""), ("pl", ""), ("an", ""), ("", ""), ("", ""), ("", "ans"), ("", "wer")]
    _, _, out = stream(ReasoningSplit(0), ["x<", "/b", "y"])   # a "<" that was not a tag goes out with the next piece
    assert out == [("x", ""), ("</b", ""), ("y", "")]


_PIECES = st.sampled_from(["<think>", "</think>", "<", "</", "think", ">", "/", " ", "\n", "a", "bc", "<th", "nk>"])


@settings(max_examples=300, deadline=None)
@given(words=st.lists(_PIECES, max_size=12), cuts=st.lists(st.integers(0, 60), max_size=8),
       closed=st.booleans())
def test_any_cut_of_a_stream_adds_up_to_the_whole_split(words, cuts, closed):
    text = "".join(words)
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])] or [""]
    split = ReasoningSplit(0, prompt_closed=closed)
    reasoning, content, _ = stream(split, pieces)
    whole_reasoning, whole_content = split.split(text)
    assert (reasoning, content) == (whole_reasoning or "", whole_content or "")


# --------------------------------------------------------------- grammars


@pytest.fixture(scope="module")
def matchers(tokenizer):
    llt = llguidance.LLTokenizer(tokenizer.to_json(), n_vocab=tokenizer.vocab_size,
                                 eos_token=list(tokenizer.eos_token_ids))

    def make(grammar: str):
        return llguidance.LLMatcher(llt, grammar, log_level=0)
    return make


def feed(matcher, ids) -> bool:
    return all(matcher.consume_token(t) for t in ids)


def test_the_reasoning_is_free_and_the_content_follows_the_grammar(tokenizer, qwen3, matchers):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    inner = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides={"whitespace_flexible": False})
    grammar = grammar_after_reasoning(inner, qwen3.end_id)
    assert llguidance.LLMatcher.validate_grammar(grammar) == ""
    ok = matchers(grammar)
    assert feed(ok, tokenizer.encode('<think>\nanything at all, even {"a": </think>{"a":12}'))
    assert ok.is_accepting() and not ok.is_error()
    refused = matchers(grammar)
    assert feed(refused, tokenizer.encode("<think>plan</think>"))
    assert not refused.consume_token(tokenizer.encode("plan")[0])
    # The answer may end while it reasons, as with no grammar; not once the content has begun.
    eos = tokenizer.eos_token_ids[0]
    thinking = matchers(grammar)
    assert feed(thinking, tokenizer.encode("plan")) and thinking.is_accepting()
    started = matchers(grammar)
    assert feed(started, tokenizer.encode('plan</think>{"a"')) and not started.is_accepting()
    assert not started.consume_token(eos)


@pytest.mark.parametrize("inner", [
    llguidance.LLMatcher.grammar_from_regex(r"yes|no"),
    llguidance.LLMatcher.grammar_from_lark('start: "yes" | "no"'),
    llguidance.grammar_from("grammar", 'root ::= "yes" | "no"'),
])
def test_every_form_of_grammar_is_wrapped(tokenizer, qwen3, matchers, inner):
    grammar = grammar_after_reasoning(inner, qwen3.end_id)
    assert [g["name"] for g in json.loads(grammar)["grammars"]][0] == "reasoning"
    yes = matchers(grammar)
    assert feed(yes, tokenizer.encode("hmm</think>yes")) and yes.is_accepting()
    assert not feed(matchers(grammar), tokenizer.encode("hmm</think>maybe"))


def test_a_closed_prompt_keeps_the_grammar_as_it_is(qwen3):
    inner = llguidance.LLMatcher.grammar_from_regex("yes")
    assert ReasoningSplit(qwen3.end_id, prompt_closed=True).grammar(inner) == inner
    assert ReasoningSplit(qwen3.end_id).grammar(inner) == grammar_after_reasoning(inner, qwen3.end_id)
    assert ReasoningSplit(qwen3.end_id).grammar("") == ""
