"""A request moved to another generator after some tokens (engine.Resumed)
goes on as if it had never moved: the text the lost generator held back
(part of a character, the start of a possible stop string) still reaches
the client, a stop string across the move ends it, its grammar and
penalties see the tokens produced before the move, and a seeded sampler
goes on with the numbers it would have drawn next."""

from __future__ import annotations

import llguidance
import msgspec
import pytest
import torch

from pipeline.engine.engine import Engine, EngineConfig
from pipeline.engine.output import Resumed, TextState
from pipeline.engine.sampler import make_generator
from pipeline.models.loader import load_model
from pipeline.processing.processor import MultimodalPrompt, Processor
from pipeline.sampling_params import SamplingParams
from test_generator_service import FakeEngine, Harness, generate, store  # noqa: F401


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    loaded = load_model(tiny_dir)
    return loaded.model, Processor.from_checkpoint(tiny_dir, loaded.config.image_token_id)


def pushed(state: TextState, ids: list[int]) -> list[str]:
    return [state.push(token_id) for token_id in ids]


def test_a_character_cut_at_the_move_arrives_whole(tiny):
    tokenizer = tiny[1].tokenizer
    ids = tokenizer.encode("ok 😀 fine")
    whole = TextState.create(tokenizer, ())
    deltas = pushed(whole, ids) + [whole.finish()]
    # A move right after a token that ends inside the emoji's bytes.
    cut = next(k for k in range(1, len(ids)) if "\ufffd" in tokenizer.decode(ids[:k]))
    sent = "".join(deltas[:cut])
    assert "😀" not in sent
    moved = TextState.resume(tokenizer, (), 0, Resumed(tuple(ids[:cut]), len(sent)))
    rest = "".join(pushed(moved, ids[cut:])) + moved.finish()
    assert sent + rest == "".join(deltas) == "ok 😀 fine"
    assert "\ufffd" not in rest


def test_a_stop_string_across_the_move_ends_the_request_and_is_never_sent(tiny):
    tokenizer = tiny[1].tokenizer
    ids = tokenizer.encode("alpha beta gamma delta")
    pieces = [tokenizer.decode(ids[:k + 1]) for k in range(len(ids))]
    # The stop string: the end of one token's text and the start of the next's.
    def spanning(k: int) -> str:
        return pieces[k][-2:] + pieces[k + 1][len(pieces[k]):len(pieces[k]) + 1]

    k = next(k for k in range(1, len(ids) - 1) if len(pieces[k]) > len(pieces[k - 1]) + 1
             and len(pieces[k + 1]) > len(pieces[k]) and spanning(k) not in pieces[k])
    stop = spanning(k)
    whole = TextState.create(tokenizer, (stop,))
    deltas = pushed(whole, ids[:k + 2])
    assert whole.stopped
    sent = "".join(deltas[:k + 1])
    assert len(sent) < len(pieces[k])   # the start of the stop string was held back
    moved = TextState.resume(tokenizer, (stop,), 0, Resumed(tuple(ids[:k + 1]), len(sent)))
    rest = moved.push(ids[k + 1])
    assert moved.stopped and sent + rest == "".join(deltas) and stop not in sent + rest
    # Not resumed, the new generator would miss the stop string.
    fresh = TextState.create(tokenizer, (stop,))
    fresh.push(ids[k + 1])
    assert not fresh.stopped


def test_min_tokens_count_the_tokens_before_the_move(tiny):
    tokenizer = tiny[1].tokenizer
    ids = tokenizer.encode("stop here stop there")
    # Asked for 6 tokens at least; 3 came before the move: the moved request's min_tokens is 3.
    moved = TextState.resume(tokenizer, ("stop",), 3, Resumed(tuple(ids[:3]), 0))
    assert moved.min_tokens == 6


def run(engine: Engine, rid: str, prompt: MultimodalPrompt, params: SamplingParams,
        resumed: Resumed | None = None, sent_after: int = 0) -> tuple[list[int], str] | tuple[list[int], str, str]:
    """(tokens, text); with sent_after, also the text streamed by the time
    that many tokens had come (what a client has at a move after them)."""
    engine.add_request(rid, prompt, [], params, resumed=resumed)
    tokens, text, sent = [], "", None
    while engine.has_work():
        for out in engine.step():
            tokens += out.new_token_ids
            text += out.new_text
            if sent_after and sent is None and len(tokens) >= sent_after:
                assert len(tokens) == sent_after, "one token an output"
                sent = text
    return (tokens, text, sent) if sent_after else (tokens, text)


def moved_prompt(prompt: MultimodalPrompt, earlier: list[int]) -> MultimodalPrompt:
    return MultimodalPrompt(prompt.token_ids + earlier, prompt.image_spans, prompt.grids)


@pytest.mark.parametrize("setting", ["penalties", "grammar", "seeded"])
def test_a_moved_request_generates_what_it_would_have_without_the_move(tiny, setting):
    model, processor = tiny
    engine = Engine(model, processor.tokenizer, EngineConfig(), torch.device("cpu"))
    messages = [{"role": "user", "content": [{"type": "text", "text": "red blue red blue cat"}]}]
    prompt = processor.chat_prompt(messages, [])
    if setting == "penalties":
        # Token 100 is pushed up until it has come once; then the penalties keep it out.
        options = dict(logit_bias=((100, 3.0),), frequency_penalty=2.0, presence_penalty=2.0,
                       repetition_penalty=1.3)
    elif setting == "seeded":   # its generator skips the numbers the tokens before the move took
        options = dict(temperature=1.0, seed=1234)
    else:
        schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}},
                  "required": ["colour"], "additionalProperties": False}
        options = dict(grammar=llguidance.LLMatcher.grammar_from_json_schema(
            schema, overrides={"whitespace_flexible": False}))
    total, cut = 12, 4
    whole, text, sent = run(engine, "whole", prompt, SamplingParams(max_tokens=total, ignore_eos=True, **options),
                            sent_after=cut)
    assert len(whole) > cut + 1
    earlier = whole[:cut]
    after = SamplingParams(max_tokens=total - cut, ignore_eos=True, **options)
    rest, rest_text = run(engine, "moved", moved_prompt(prompt, earlier), after, Resumed(tuple(earlier), len(sent)))
    assert rest == whole[cut:] and sent + rest_text == text
    # Without what came before the move, the same request goes elsewhere: the test tells them apart.
    blind, _ = run(engine, "blind", moved_prompt(prompt, earlier), after)
    assert blind != whole[cut:]
    assert not engine.live and engine.penalties.free and not engine.has_work()


@pytest.mark.parametrize("drawn", [1, 7, 300, 20000])
def test_skipping_draws_in_one_call_is_drawing_them_one_by_one(drawn):
    # make_generator's fast-forward stands for `drawn` single draws (draw.uniforms).
    one_by_one = torch.Generator().manual_seed(99)
    for _ in range(drawn):
        torch.rand(1, generator=one_by_one)
    skipped = make_generator(SamplingParams(max_tokens=1, temperature=0.7, seed=99), drawn)
    assert torch.equal(torch.rand(4, generator=skipped), torch.rand(4, generator=one_by_one))


def test_a_resumed_prompt_must_end_with_the_earlier_tokens(tiny):
    model, processor = tiny
    engine = Engine(model, processor.tokenizer, EngineConfig(), torch.device("cpu"))
    prompt = MultimodalPrompt([1, 2, 3], [], [])
    with pytest.raises(ValueError, match="must end with"):
        engine.add_request("r", prompt, [], SamplingParams(max_tokens=2), resumed=Resumed((4,), 0))
    assert not engine.live and not engine.has_work()


def test_the_generator_hands_a_moved_request_s_earlier_tokens_cache_salt_and_priority_to_its_engine(store):
    harness = Harness(store, FakeEngine())
    try:
        moved = msgspec.structs.replace(generate("r~1"), resumed_output=(4, 5), resumed_text_sent=3,
                                        cache_salt="tenant-a", priority=-2)
        harness.turn(moved, generate("fresh"))
        assert harness.engine.resumed == {"r~1": Resumed((4, 5), 3), "fresh": None}
        assert harness.engine.salts == {"r~1": "tenant-a", "fresh": ""}
        assert harness.engine.priorities == {"r~1": -2, "fresh": 0}
    finally:
        harness.service.close()
