"""n > 1 through the served stack (openai SDK): n choices with their
indices, seeded ones reproducible wherever each copy runs, streamed equal
to not streamed, usage counting the prompt once; greedy choices all equal
the one greedy answer; a bad image still fails the request as a 400. And a
batch of completion prompts: each prompt's choices as if it came alone,
numbered prompt by prompt, usage counting each prompt once."""

from __future__ import annotations

import openai
import pytest

from conftest import image_bytes, random_image
from e2e_helpers import chat_messages, client, serving
from stack import Stack


@pytest.fixture(scope="module")
def served(tiny_dir, tmp_path_factory):
    yield from serving(Stack(tmp_path_factory.mktemp("n-choices"), tiny_dir, encoders=1, generators=2))


IMAGE = [image_bytes(random_image(60, 80, seed=21))]


def ask(stack, n, stream=False, **extra):
    kwargs = dict(model="tiny", messages=chat_messages(IMAGE, "Say something."), max_tokens=8, n=n,
                  extra_body={"ignore_eos": True}, **extra)
    if not stream:
        reply = client(stack).chat.completions.create(**kwargs)
        assert [c.index for c in reply.choices] == list(range(n))
        return [c.message.content for c in reply.choices], reply.usage
    texts, usage = [""] * n, None
    for chunk in client(stack).chat.completions.create(**kwargs, stream=True,
                                                       stream_options={"include_usage": True}):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
        usage = chunk.usage or usage
    return texts, usage


def test_seeded_choices_are_reproducible_and_streaming_agrees(served):
    texts, usage = ask(served, 3, temperature=1.0, seed=1234)
    assert len(set(texts)) > 1    # three samples, not one answer three times
    assert usage.completion_tokens == 3 * 8 and usage.prompt_tokens > 0
    again, _ = ask(served, 3, temperature=1.0, seed=1234)
    assert again == texts
    streamed, streamed_usage = ask(served, 3, stream=True, temperature=1.0, seed=1234)
    assert streamed == texts and streamed_usage.completion_tokens == 24
    alone, _ = ask(served, 1, temperature=1.0, seed=1234)
    assert alone == texts[:1]     # choice 0 is the request's own seed


def test_greedy_choices_are_the_greedy_answer(served):
    greedy, _ = ask(served, 1, temperature=0)
    texts, _ = ask(served, 4, temperature=0)
    assert texts == greedy * 4


def test_limits_and_bad_media_with_n(served):
    with pytest.raises(openai.BadRequestError, match="n must be"):
        ask(served, 17)
    bad = dict(model="tiny", messages=chat_messages([b"not an image"], "x"), max_tokens=2, n=2)
    with pytest.raises(openai.BadRequestError, match="image 1"):
        client(served).chat.completions.create(**bad)
    texts, _ = ask(served, 2, temperature=0)   # and the stack serves on
    assert len(texts) == 2


def complete(stack, prompt, n=1, stream=False, **extra):
    kwargs = dict(model="tiny", prompt=prompt, max_tokens=6, n=n, temperature=0, extra_body={"ignore_eos": True},
                  **extra)
    if not stream:
        reply = client(stack).completions.create(**kwargs)
        assert [c.index for c in reply.choices] == list(range(len(reply.choices)))
        return [c.text for c in reply.choices], reply.usage
    texts, usage = {}, None
    for chunk in client(stack).completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + choice.text
        usage = chunk.usage or usage
    return [texts[i] for i in sorted(texts)], usage


def test_a_batch_of_completion_prompts_is_answered_prompt_by_prompt(served):
    prompts = ["The first one", "A second, longer prompt than the first", "Three"]
    alone = [complete(served, p) for p in prompts]
    texts, usage = complete(served, prompts)
    assert texts == [text for (text,), _ in alone]   # greedy: each choice as its prompt alone
    assert usage.prompt_tokens == sum(u.prompt_tokens for _, u in alone)   # each prompt once
    assert usage.completion_tokens == 3 * 6
    # n copies of each, choice k * n + i: prompt k's i-th (vLLM's numbering), streamed the same.
    doubled, doubled_usage = complete(served, prompts, n=2)
    assert doubled == [t for t in texts for _ in range(2)] and doubled_usage.prompt_tokens == usage.prompt_tokens
    streamed, streamed_usage = complete(served, prompts, n=2, stream=True)
    assert streamed == doubled and streamed_usage.completion_tokens == 6 * 6
    # Token ids, one list or a batch of them.
    ids = [[11, 12, 13], [21, 22]]
    assert complete(served, ids)[0] == [complete(served, i)[0][0] for i in ids]


@pytest.mark.parametrize("prompt, fragment", [
    ([], "non-empty list"), (["a", [1, 2]], "non-empty list"), ([[1, 2], []], "a prompt of the batch is empty"),
    (["a", ""], "a prompt of the batch is empty"), ([1, "a"], "non-empty list"), ({"a": 1}, "prompt")])
def test_a_bad_batch_of_prompts_is_a_400_naming_the_prompt(served, prompt, fragment):
    with pytest.raises(openai.BadRequestError, match=fragment):
        client(served).completions.create(model="tiny", prompt=prompt, max_tokens=2)
