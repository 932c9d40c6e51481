"""Sampling a token for each of a batch of rows in one float32 pass:
temperature, then min_p, top_k and top_p as cuts, then one uniform number a
row picks the token by inverse CDF.

Semantics (each row its own settings):
- temperature t > 0: the logits are divided by t;
- min_p m (0: off), after temperature: tokens less likely than m times the
  likeliest are cut (penalties.apply_min_p);
- top_k k (0, or at least the vocabulary: off): tokens below the k-th
  largest logit are cut (ties with it stay);
- top_p p (1: off): of what is left, the smallest prefix of the likeliest
  tokens whose mass reaches p stays, always the first (ties with the last
  kept stay too).

Every cut is a floor on a row's values, so a row's kept tokens do not
depend on how its floors were found: one descending sort of the rows, or a
top-k of the widest k when every row has a small top_k (TOPK_CAP). The
draw walks the kept tokens in vocabulary order, so a row's token depends
only on its own logits, settings and uniform number, whatever else is in
the batch: a seeded row takes its number from its own generator (one
float32 from a CPU generator, cheap), the others from the global RNG, and
all reach the device in one queued copy with the settings.
"""

from __future__ import annotations

import torch

from pipeline.engine.penalties import apply_min_p
from pipeline.sampling_params import SamplingParams
from pipeline.engine.small_copies import device_tensor

# Every row's top_k at most this: its floors come from a top-k of the
# largest top_k, cheaper than sorting whole rows of a 150k vocabulary.
TOPK_CAP = 1024


def draw(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> torch.Tensor:
    """logits [m, vocab] float32 (changed in place), row i sampled with
    params[i] (temperature > 0) and generators[i] (None: the global RNG) ->
    token ids [m] on the logits' device."""
    vocab = logits.shape[1]
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    settings = device_tensor([[p.temperature for p in params], [p.min_p for p in params], ks,
                              [p.top_p for p in params], uniforms(generators)], torch.float32, logits.device)
    temperature, min_p, top_k, top_p, uniform = settings
    x = logits.div_(temperature.unsqueeze(1))
    if any(p.min_p > 0 for p in params):
        x = apply_min_p(x, min_p)
    use_p = any(p.top_p < 1.0 for p in params)
    if use_p or min(ks) < vocab:
        x = x.masked_fill(x < top_floor(x, top_k.long(), top_p, max(ks), use_p), float("-inf"))
    return inverse_cdf(x, uniform)


def uniforms(generators: list[torch.Generator | None]) -> list[float]:
    """One number in [0, 1) a row: from the row's own generator, or for the
    rows without one from the global RNG in one call."""
    shared = iter(torch.rand(sum(g is None for g in generators)).tolist())
    return [next(shared) if g is None else float(torch.rand(1, generator=g)) for g in generators]


def top_floor(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, widest_k: int, use_p: bool) -> torch.Tensor:
    """x [m, vocab] -> [m, 1]: the least value a row keeps under its top_k
    (vocab: off) and top_p (1: off); -inf where nothing is cut."""
    vocab = x.shape[1]
    if widest_k <= TOPK_CAP and widest_k < vocab:
        ordered = x.topk(widest_k, dim=-1).values   # every row's cut lies inside its widest_k largest
    else:
        ordered = x.sort(dim=-1, descending=True).values
    kth = ordered.gather(1, (top_k - 1).unsqueeze(1))
    if not use_p:
        return kth
    kept = ordered.masked_fill(ordered < kth, float("-inf"))
    probs = kept.softmax(-1)
    # A token goes when the mass before it already reaches top_p; the first never does.
    reached = probs.cumsum(-1) - probs >= top_p.unsqueeze(1)
    last = (~reached).sum(-1, keepdim=True).clamp_(min=1) - 1
    # max with kth: rounding may carry `last` into the cut tail (-inf) when top_p is near 1.
    floor = torch.maximum(ordered.gather(1, last), kth)
    return torch.where(top_p.unsqueeze(1) < 1.0, floor, kth)


def inverse_cdf(x: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """x [m, vocab] (cut tokens at -inf), uniform [m] in [0, 1) -> the first
    token of each row whose cumulative probability passes uniform times the
    row's total (the total, not 1: float sums fall short). A token of zero
    probability adds nothing to the sum, so it is never the first to pass."""
    cdf = x.softmax(-1).cumsum_(-1)
    total = cdf[:, -1:]
    # Strictly under the total, or rounding could pass no token at all.
    target = torch.minimum(uniform.unsqueeze(1) * total, torch.nextafter(total, torch.zeros_like(total)))
    # A row with every token cut (bans that met allowed_token_ids) sums to NaN:
    # its pick is clamped into the vocabulary rather than past it.
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=x.shape[1] - 1)
