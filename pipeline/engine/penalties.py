"""The logits processors a request can ask for, applied to a whole batch at
once: logit_bias, the repetition, frequency and presence penalties, and
min_p (the last after temperature, with the other cuts in the sampler).

The penalties need each request's token counts. They live on the device in
one pool with a row per penalised request, taken when its first token is
sampled and given back when it ends (about 0.7 MB a row at a 150k
vocabulary). A step adds the batch's new tokens with one scatter, and
penalises the batch's rows in place: on CUDA one Triton kernel
(kernels/penalties.py) reads each row's logits, counts and seen flags from
the pool and writes the row back; elsewhere the whole-tensor operations of
penalise_rows_reference, which define the maths the kernel repeats. No
Python loop over tokens, none over the batch beyond gathering its rows'
settings, and the settings reach the device in queued copies
(small_copies.py), not ones that wait for the forward.

Semantics as the common servers and transformers have them:
- repetition_penalty r (1: off): a token seen in the prompt or the output
  has its logit divided by r if positive, multiplied by r if not;
- frequency_penalty f and presence_penalty p (0: off), OpenAI's: the logit
  minus f times the token's count in the output, minus p if it occurs there;
- logit_bias: a number added to a token's logit;
- min_p m (0: off): tokens less likely than m times the likeliest are cut.
"""

from __future__ import annotations

import torch

from pipeline.sampling_params import SamplingParams
from pipeline.engine.small_copies import device_tensor, steady_tensor


def uses_penalties(params: SamplingParams) -> bool:
    return (params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0
            or params.presence_penalty != 0.0)


class PenaltyPool:
    """Token counts of the penalised requests: `counts[row]` in the output,
    `seen[row]` in the prompt or the output."""

    def __init__(self, vocab_size: int, capacity: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.capacity = capacity
        self.device = device
        self.counts: torch.Tensor | None = None   # [capacity, vocab] float32, made on first use
        self.seen: torch.Tensor | None = None     # [capacity, vocab] bool
        self.free = list(range(capacity - 1, -1, -1))

    def take(self, prompt_ids: list[int], earlier_output: tuple[int, ...] = ()) -> int:
        """A row for a new request, its prompt's tokens marked as seen, and
        the output it produced before a move (the end of its prompt here)
        counted. The pool doubles when full (preempted requests keep their rows)."""
        if self.counts is None:
            self.counts = torch.zeros(self.capacity, self.vocab_size, dtype=torch.float32, device=self.device)
            self.seen = torch.zeros(self.capacity, self.vocab_size, dtype=torch.bool, device=self.device)
        if not self.free:
            self.free = list(range(2 * self.capacity - 1, self.capacity - 1, -1))
            self.counts = torch.cat((self.counts, torch.zeros_like(self.counts)))
            self.seen = torch.cat((self.seen, torch.zeros_like(self.seen)))
            self.capacity *= 2
        row = self.free.pop()
        self.counts[row].zero_()
        self.seen[row].zero_()
        self.seen[row, device_tensor([t for t in prompt_ids if 0 <= t < self.vocab_size], torch.long,
                                     self.device)] = True
        if earlier_output:
            self.record([row] * len(earlier_output), list(earlier_output))
        return row

    def give_back(self, row: int) -> None:
        self.free.append(row)

    def record(self, rows: list[int], tokens: list[int] | torch.Tensor) -> None:
        """The step's sampled tokens of these pool rows (a list, or a tensor
        on the pool's device, which needs no copy), by flat position: one
        kernel each for index_add_ and index_fill_, where index_put_'s
        accumulate cost the host about 0.4 ms a call on CUDA. Adding ones is
        exact in any order, repeated positions included."""
        if not rows:
            return
        if not isinstance(tokens, torch.Tensor):
            tokens = device_tensor(tokens, torch.long, self.device)
        flat = steady_tensor("pool_rows", tuple(rows), torch.long, self.device) * self.vocab_size + tokens.long()
        self.counts.view(-1).index_add_(0, flat, torch.ones(len(rows), device=self.device))
        self.seen.view(-1).index_fill_(0, flat, True)


def apply_bias_and_penalties(logits: torch.Tensor, params: list[SamplingParams], pool_rows: list[int | None],
                             pool: PenaltyPool | None) -> None:
    """In place on float32 logits [n, vocab]; row i is params[i]'s request,
    whose counts are pool row pool_rows[i] (None: not penalised)."""
    vocab = logits.shape[1]
    biased = [(i * vocab + token, bias) for i, p in enumerate(params) for token, bias in p.logit_bias]
    if biased:
        # A request's logit_bias names a token once, so the flat positions are distinct.
        flat, values = zip(*biased)
        logits.view(-1).index_add_(0, steady_tensor("bias_at", flat, torch.long, logits.device),
                                   steady_tensor("bias", values, logits.dtype, logits.device))
    penalised = [i for i, row in enumerate(pool_rows) if row is not None]
    if not penalised or pool is None:
        return
    batch, slots = steady_tensor("penalised", (tuple(penalised), tuple(pool_rows[i] for i in penalised)),
                                 torch.long, logits.device)
    settings = steady_tensor("penalties", (tuple(params[i].repetition_penalty for i in penalised),
                                           tuple(params[i].frequency_penalty for i in penalised),
                                           tuple(params[i].presence_penalty for i in penalised)),
                             logits.dtype, logits.device)
    if logits.is_cuda and pool.counts.device == logits.device:
        from pipeline.kernels.penalties import penalise_rows   # imports triton: CUDA only

        penalise_rows(logits, batch, slots, pool.counts, pool.seen, settings)
    else:
        penalise_rows_reference(logits, batch, slots, pool.counts, pool.seen, settings)


def penalise_rows_reference(logits: torch.Tensor, batch: torch.Tensor, slots: torch.Tensor, counts: torch.Tensor,
                            seen: torch.Tensor, settings: torch.Tensor) -> None:
    """Rows `batch` of float32 logits [n, vocab], in place, penalised by the
    pool's rows `slots` of counts and seen [capacity, vocab]; settings [3,
    len(batch)]: repetition, frequency, presence. The definition: the CPU
    path, and what kernels/penalties.py is tested against."""
    counts, seen = counts[slots].to(logits.device), seen[slots].to(logits.device)
    repetition, frequency, presence = settings.unsqueeze(2)
    scores = logits[batch]
    repeated = torch.where(scores > 0, scores / repetition, scores * repetition)
    scores = torch.where(seen, repeated, scores)
    scores = scores - frequency * counts - presence * (counts > 0).to(scores.dtype)
    logits[batch] = scores


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """logits [n, vocab] (temperature applied), min_p [n] (0: off) -> the
    logits with the tokens under min_p times the likeliest set to -inf."""
    probs = logits.softmax(-1)
    floor = min_p.unsqueeze(1) * probs.max(-1, keepdim=True).values
    return logits.masked_fill(probs < floor, float("-inf"))
