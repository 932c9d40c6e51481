"""vLLM's output options in the engine, on the tiny model:
include_stop_str_in_output (the stop string, or a stop token's text, ends
the text; nothing is held back), skip_special_tokens false (special tokens'
text kept), and allowed_token_ids (every other token cut, greedy or drawn,
in a batch beside unrestricted rows), bad_words (a word's last token banned
where the output ends with the rest); a request whose allowed tokens all
end it under min_tokens is refused."""

from __future__ import annotations

import pytest
import torch

from pipeline.engine.config import EngineConfig
from pipeline.engine.engine import Engine
from pipeline.engine.output import TextState
from pipeline.engine.sampler import SamplingRow, bad_word_bans, sample
from pipeline.sampling_params import SamplingParams
from test_engine import make_request, tiny  # noqa: F401 (tiny: the module fixture)


@pytest.fixture(scope="module")
def engine_run(tiny):
    model, processor = tiny
    prompt, _, _ = make_request(processor, 5, 0)
    engine = Engine(model, processor.tokenizer, EngineConfig(), torch.device("cpu"))

    def run(rid, **params):
        """One request alone: (tokens, reason, the text deltas)."""
        engine.add_request(rid, prompt, [], SamplingParams(**params))
        tokens, reason, deltas = [], None, []
        while engine.has_work():
            for out in engine.step():
                tokens += out.new_token_ids
                deltas.append(out.new_text)
                reason = out.finish_reason or reason
        return tokens, reason, deltas
    run.engine, run.tokenizer, run.prompt = engine, processor.tokenizer, prompt
    return run


def test_include_stop_str_in_output_keeps_the_stop_and_holds_nothing_back(engine_run):
    greedy, _, deltas = engine_run("g", max_tokens=10, ignore_eos=True)
    text = "".join(deltas)
    target = text[5:8]
    assert target.strip(), "the tiny model's greedy text has no stop string to test with"
    _, reason, deltas = engine_run("in", max_tokens=10, stop=[target], ignore_eos=True, include_stop_str_in_output=True)
    assert reason == "stop" and "".join(deltas) == text[:text.index(target) + len(target)]
    # A stop token's text, left out by default, is kept with the option.
    stop_id = greedy[3]
    first = greedy.index(stop_id)
    tokens, reason, deltas = engine_run("tok", max_tokens=10, stop_token_ids=[stop_id], ignore_eos=True,
                                        include_stop_str_in_output=True)
    assert tokens == greedy[:first + 1] and reason == "stop"
    assert "".join(deltas) == engine_run.tokenizer.decode(greedy[:first + 1])


def test_a_stop_strings_beginning_is_sent_at_once_when_it_is_kept(engine_run):
    """Without the option, text that may begin a stop string waits; with it,
    nothing does (the text is the same either way until the stop completes)."""
    tokenizer = engine_run.tokenizer
    ids = tokenizer.encode("the cat sat on the mat")
    deltas, tail = {}, {}
    for include in (False, True):
        state = TextState.create(tokenizer, ("the mat!",), include_stop=include)
        deltas[include] = [state.push(t) for t in ids]
        tail[include] = state.finish()
    decoded = [tokenizer.decode(ids[:n]) for n in range(len(ids) + 1)]
    assert deltas[True] == [b[len(a):] for a, b in zip(decoded, decoded[1:])]   # each token's text at once
    assert "".join(deltas[False]) == "the cat sat on " and tail[False] == "the mat"
    assert "".join(deltas[True]) + tail[True] == decoded[-1] == "the cat sat on the mat"


def test_skip_special_tokens_false_keeps_their_text(engine_run):
    eos = engine_run.tokenizer.eos_token_ids[0]
    forced = dict(max_tokens=3, logit_bias=((eos, 100.0),), ignore_eos=True)
    tokens, _, deltas = engine_run("skip", **forced)
    assert tokens == [eos] * 3 and "".join(deltas) == ""
    _, _, deltas = engine_run("keep", **forced, skip_special_tokens=False)
    name = engine_run.tokenizer.decode([eos], skip_special_tokens=False)
    assert name and "".join(deltas) == name * 3


def test_allowed_token_ids_cut_every_other_token(engine_run):
    greedy, _, _ = engine_run("free", max_tokens=8, ignore_eos=True)
    allowed = sorted(set(range(40, 60)) - set(greedy))   # none of the free answer's tokens
    for rid, extra in (("greedy", {}), ("drawn", dict(temperature=1.0, seed=3))):
        tokens, _, _ = engine_run(rid, max_tokens=8, ignore_eos=True, allowed_token_ids=allowed, **extra)
        assert len(tokens) == 8 and set(tokens) <= set(allowed), tokens
    # The free answer's first token, allowed among others, is still the greedy choice.
    tokens, _, _ = engine_run("with-first", max_tokens=1, allowed_token_ids=[greedy[0], *allowed])
    assert tokens == greedy[:1]
    eos = engine_run.tokenizer.eos_token_ids[0]
    with pytest.raises(ValueError, match="min_tokens"):
        engine_run.engine.add_request("none-left", engine_run.prompt, [],
                                      SamplingParams(max_tokens=4, min_tokens=2, allowed_token_ids=(eos,)))
    with pytest.raises(ValueError, match="vocabulary"):
        engine_run.engine.add_request("too-big", engine_run.prompt, [],
                                      SamplingParams(max_tokens=4, allowed_token_ids=(10**6,)))
    assert not engine_run.engine.live


def test_allowed_rows_beside_free_rows_in_one_batch():
    torch.manual_seed(0)
    logits = torch.randn(3, 32)
    raw = logits.clone()
    rows = [SamplingRow(SamplingParams(max_tokens=1), None),
            SamplingRow(SamplingParams(max_tokens=1, allowed_token_ids=(4, 9)), None),
            SamplingRow(SamplingParams(max_tokens=1, allowed_token_ids=(30,), logit_bias=((2, 50.0),)), None)]
    tokens = sample(logits, rows)
    assert torch.equal(logits, raw)
    assert tokens[0] == int(raw[0].argmax()) and tokens[1] == (4 if raw[1, 4] > raw[1, 9] else 9)
    assert tokens[2] == 30   # a bias on a cut token does not bring it back


def test_bad_word_bans():
    words = ((7,), (1, 2), (3, 4, 5))
    assert bad_word_bans(words, []) == {7}
    assert bad_word_bans(words, [9, 1]) == {7, 2}
    assert bad_word_bans(words, [3, 4]) == {7, 5} and bad_word_bans(words, [4, 3]) == {7}


def test_bad_words_never_appear(engine_run):
    greedy, _, _ = engine_run("free-bw", max_tokens=10, ignore_eos=True)
    pair = (greedy[2], greedy[3])
    tokens, _, _ = engine_run("no-pair", max_tokens=10, ignore_eos=True, bad_words_token_ids=(pair,))
    first = next(i for i in range(len(greedy) - 1) if (greedy[i], greedy[i + 1]) == pair)
    # The same way until the word would end there.
    assert tokens[:first + 1] == greedy[:first + 1] and tokens[first + 1] != greedy[first + 1]
    assert all((a, b) != pair for a, b in zip(tokens, tokens[1:]))
    tokens, _, _ = engine_run("no-token", max_tokens=10, ignore_eos=True, bad_words_token_ids=((greedy[0],),))
    assert greedy[0] not in tokens
