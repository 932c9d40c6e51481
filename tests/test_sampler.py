"""The batched sampler (engine/sampler.py, engine/draw.py) on random logits:
the tokens it draws follow the distribution the per-row definition gives
(temperature, min_p, top_k, top_p, several settings in one batch), cut
tokens never come, the degenerate settings are greedy, a seeded row gives
the same tokens whatever its batch companions, and the caller's logits stay
as they were."""

from __future__ import annotations

import pytest
import torch

from pipeline.engine.draw import TOPK_CAP, draw, inverse_cdf
from pipeline.engine.penalties import PenaltyPool
from pipeline.sampling_params import SamplingParams
from pipeline.engine.sampler import SamplingRow, make_generator, sample

VOCAB = 16


def reference_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row's final distribution by the definition: the per-row code the
    sampler used before it was batched."""
    logits = logits / p.temperature
    if p.min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    if 0 < p.top_k < logits.shape[-1]:
        logits = logits.masked_fill(logits < torch.topk(logits, p.top_k).values[-1], float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= p.top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits.softmax(-1)


def params(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=4, **kw)


SETTINGS = [params(temperature=1.0), params(temperature=0.7, top_p=0.8), params(temperature=1.3, min_p=0.2),
            params(temperature=1.0, top_k=4), params(temperature=0.9, top_k=6, top_p=0.7, min_p=0.02)]


@pytest.mark.parametrize("small_k", [False, True])
def test_draws_follow_the_reference_distribution(small_k):
    """Every setting in one batch, each row repeated: the frequencies match
    the definition's probabilities and no cut token is ever drawn. small_k:
    every row has a small top_k, the top-k path instead of the sort."""
    settings = [params(temperature=1.0, top_k=5), params(temperature=0.8, top_k=3, top_p=0.6, min_p=0.05)] \
        if small_k else SETTINGS
    torch.manual_seed(0)
    base = torch.randn(len(settings), VOCAB)
    repeats = 20000
    logits = base.repeat_interleave(repeats, 0)
    rows = [p for p in settings for _ in range(repeats)]
    tokens = draw(logits.clone(), rows, [None] * len(rows)).view(len(settings), repeats)
    choices = []
    for i, p in enumerate(settings):
        want = reference_probs(base[i], p)
        got = torch.bincount(tokens[i], minlength=VOCAB).float() / repeats
        assert torch.all(got[want == 0] == 0), p                 # a cut token never comes
        assert (got - want).abs().max() < 0.02, (p, got, want)   # ~6 standard deviations at 20000 draws
        choices.append(int((want > 0).sum()))
    # Every setting leaves a choice, and all but plain temperature cut something.
    assert min(choices) > 1 and sum(c < VOCAB for c in choices) >= len(settings) - 1, choices


def test_degenerate_settings_are_greedy():
    torch.manual_seed(1)
    logits = torch.randn(6, VOCAB) * 3
    greedy = logits.argmax(-1)
    for setting in (params(temperature=2.0, top_k=1, seed=3), params(temperature=2.0, top_p=1e-6, seed=3),
                    params(temperature=1.5, min_p=1.0, seed=3)):
        rows = [SamplingRow(setting, make_generator(setting)) for _ in range(6)]
        for _ in range(5):
            assert sample(logits, rows) == greedy.tolist(), setting


def test_top_p_keeps_the_smallest_prefix():
    # probabilities 0.5, 0.3, 0.2: top_p 0.5 keeps the first alone, 0.6 the first two.
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log().repeat(4000, 1)
    for top_p, allowed in ((0.5, {0}), (0.6, {0, 1}), (0.85, {0, 1, 2})):
        tokens = draw(logits.clone(), [params(temperature=1.0, top_p=top_p)] * 4000, [None] * 4000)
        assert set(tokens.tolist()) == allowed, top_p


def test_min_p_cuts_after_temperature():
    # probabilities 0.6, 0.3, 0.1: min_p 0.2 cuts the last (0.1 < 0.12); at
    # temperature 3 the distribution flattens and it comes back.
    logits = torch.tensor([[0.6, 0.3, 0.1]]).log().repeat(4000, 1)
    cold = draw(logits.clone(), [params(temperature=1.0, min_p=0.2)] * 4000, [None] * 4000)
    hot = draw(logits.clone(), [params(temperature=3.0, min_p=0.2)] * 4000, [None] * 4000)
    assert set(cold.tolist()) == {0, 1} and set(hot.tolist()) == {0, 1, 2}


def test_inverse_cdf_skips_cut_tokens_at_the_edges():
    x = torch.tensor([[float("-inf"), 1.0, float("-inf"), 2.0, float("-inf")]] * 3)
    # 0 would land on the cut first token, 1 - 2^-24 past the float total onto the cut last one.
    tokens = inverse_cdf(x, torch.tensor([0.0, 0.5, 1 - 2 ** -24]))
    assert tokens.tolist() == [1, 3, 3]


def run_seeded(companions: list[SamplingParams], steps: int = 6) -> list[int]:
    """A seeded row's tokens over `steps` calls of sample(), batched with
    `companions` (unseeded, penalised or greedy alike), on fixed logits per step."""
    mine = params(temperature=1.0, top_k=8, top_p=0.9, seed=42)
    pool = PenaltyPool(VOCAB, 4, torch.device("cpu"))
    rows = [SamplingRow(p, make_generator(p), pool_row=pool.take([1, 2]) if p.repetition_penalty != 1 else None)
            for p in companions]
    rows.insert(len(rows) // 2, SamplingRow(mine, make_generator(mine)))
    at = len(companions) // 2
    out = []
    for step in range(steps):
        gen = torch.Generator().manual_seed(100 + step)
        logits = torch.randn(len(rows), VOCAB, generator=gen)
        logits[at] = torch.randn(VOCAB, generator=torch.Generator().manual_seed(step))   # the seeded row's own
        out.append(sample(logits, rows, pool)[at])
    return out


def test_a_seeded_row_ignores_its_batch():
    alone = run_seeded([])
    # Companions that send the batch down the sort path, the top-k path's
    # widest k, greedy rows and penalties: the seeded row's tokens stay.
    assert run_seeded([params(temperature=0.5), params(), params(temperature=1.0, top_p=0.3)]) == alone
    assert run_seeded([params(temperature=1.0, top_k=3), params(temperature=2.0, top_k=TOPK_CAP, min_p=0.3)]) == alone
    assert run_seeded([params(repetition_penalty=1.5), params(temperature=1.0, seed=7)] * 2) == alone
    assert len(set(alone)) > 1   # it samples, not a constant


def test_greedy_rows_and_processors_in_a_mixed_batch():
    torch.manual_seed(2)
    logits = torch.randn(4, VOCAB)
    logits[3, 7], logits[3, 9] = 4.0, 3.0   # token 7 leads until the penalty halves it
    raw = logits.clone()
    pool = PenaltyPool(VOCAB, 2, torch.device("cpu"))
    settings = [params(), params(temperature=1.0, seed=1), params(logit_bias=((5, 50.0),)),
                params(repetition_penalty=2.0)]
    rows = [SamplingRow(settings[0], None, banned=(int(logits[0].argmax()),)),
            SamplingRow(settings[1], make_generator(settings[1])),
            SamplingRow(settings[2], None),
            SamplingRow(settings[3], None, pool_row=pool.take([7]))]
    tokens = sample(logits, rows, pool)
    assert torch.equal(logits, raw)   # the caller's float32 logits are left raw
    assert tokens[0] == int(logits[0].topk(2).indices[1])   # the banned argmax gives way to the second
    assert tokens[2] == 5 and tokens[3] == 9
    again = [SamplingRow(settings[1], make_generator(settings[1]))]
    assert sample(logits[1:2], again) == [tokens[1]]   # the sampled row alone draws the same
