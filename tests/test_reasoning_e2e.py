"""--reasoning-parser on the served stack (real processes), on a copy of the
tiny random model that has Qwen3's think tokens (tests/thinking_model.py):
a grammar leaves the reasoning free (greedy tokens as without the grammar)
and holds the content after `</think>`, or all of the answer once the prompt
has closed the reasoning; whole and streamed answers agree."""

from __future__ import annotations

import json
import urllib.request

import pytest

from e2e_helpers import serving
from stack import Stack
from thinking_model import with_thinking

CHOICE = {"structured_outputs": {"choice": ["yes", "no"]}}
OFF = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def served(tiny_dir, tmp_path_factory):
    model = with_thinking(tiny_dir, tmp_path_factory.mktemp("thinking-model") / "ckpt", weights=True)
    yield from serving(Stack(tmp_path_factory.mktemp("reasoning-e2e"), model, encoders=0, generators=1,
                             aggregated=True, proxy_args=("--reasoning-parser", "qwen3")))


def post(stack, body: dict) -> bytes:
    request = urllib.request.Request(stack.base_url + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return response.read()


def ask(stack, stream: bool = False, **fields) -> dict:
    """The answer's message (streamed: added up), its finish reason and token count."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Think, then answer."}], "max_tokens": 10,
            "temperature": 0, **fields}
    if not stream:
        reply = json.loads(post(stack, body))
        return {**reply["choices"][0]["message"], "finish_reason": reply["choices"][0]["finish_reason"],
                "tokens": reply["usage"]["completion_tokens"]}
    raw = post(stack, {**body, "stream": True, "stream_options": {"include_usage": True}}).decode()
    chunks = [json.loads(line[6:]) for line in raw.split("\n\n") if line.startswith("data: {")]
    out = {"reasoning": "", "content": "", "finish_reason": None, "tokens": chunks[-1]["usage"]["completion_tokens"]}
    for chunk in chunks:
        for choice in chunk["choices"]:
            out["reasoning"] += choice["delta"].get("reasoning") or ""
            out["content"] += choice["delta"].get("content") or ""
            out["finish_reason"] = choice["finish_reason"] or out["finish_reason"]
    return out


def end_id(stack) -> int:
    tokens = json.loads(urllib.request.urlopen(urllib.request.Request(
        stack.base_url + "/tokenize", json.dumps({"model": "tiny", "prompt": "</think>"}).encode(),
        {"Content-Type": "application/json"})).read())["tokens"]
    assert len(tokens) == 1
    return tokens[0]


def test_a_grammar_leaves_the_reasoning_free(served):
    free = ask(served)
    held = ask(served, **CHOICE)
    assert "</think>" not in free["reasoning"] and free["content"] is None and free["finish_reason"] == "length"
    assert held == free   # the same greedy tokens: nothing held the reasoning
    streamed = ask(served, stream=True, **CHOICE)
    assert (streamed["reasoning"], streamed["content"]) == (free["reasoning"], "")


def test_the_content_after_the_reasoning_follows_the_grammar(served):
    # A bias on </think> ends the reasoning at once; the grammar then allows only its choices.
    bias = {"logit_bias": {str(end_id(served)): 100}}
    whole = ask(served, **CHOICE, **bias)
    assert whole["reasoning"] == "" and whole["content"] in ("yes", "no") and whole["finish_reason"] == "stop"
    streamed = ask(served, stream=True, **CHOICE, **bias)
    assert (streamed["reasoning"], streamed["content"]) == ("", whole["content"])
    # Without the grammar the bias writes </think> again and again.
    assert ask(served, **bias)["content"].startswith("</think>")


def test_a_prompt_that_closed_the_reasoning_holds_all_the_answer(served):
    whole = ask(served, **CHOICE, **OFF)
    assert whole["reasoning"] is None and whole["content"] in ("yes", "no") and whole["finish_reason"] == "stop"
    assert ask(served, stream=True, **CHOICE, **OFF)["content"] == whole["content"]
