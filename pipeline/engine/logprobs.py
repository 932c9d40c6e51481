"""Log-probabilities for the requests that ask for them: the chosen token's
and the top k of the model's own distribution (before temperature, bias,
penalties or any cut, as the common servers return by default).

log_softmax(x) is x - logsumexp(x), and subtracting a row's constant keeps
the order, so the batch takes one top-k of the logits as they are, one
logsumexp a row and one gather for the chosen tokens, instead of a full
log-probability table. The chosen tokens may still be on the device
(engine/choose.py queues this before the step's one wait), and the table
reaches the host in the same copy as the tokens.

The top-k goes in two stages on wide rows: torch's top-k of a whole
150k-token row works a row at a time, while the top k of each 2,048-token
chunk and then the top k of those k-per-chunk candidates spread over many
more blocks. A row's top k is among its chunks' top k, so the result is the
same set (ties aside, whose order is free either way).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from pipeline.engine.small_copies import device_tensor

# (the chosen token's logprob, the top k ids, their logprobs), per token.
TokenLogprobs = tuple[float, tuple[int, ...], tuple[float, ...]]
MAX_TOP_LOGPROBS = 20
CHUNK = 2048


def largest(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, vocab] -> (values, ids) [n, k] of each row's k largest, in
    descending order: two stages on CUDA's wide rows (the CPU's top-k is
    faster whole)."""
    if not x.is_cuda or x.shape[1] < 8 * CHUNK or k > 64:
        return x.topk(k, dim=-1)
    return two_stage_top(x, k)


def two_stage_top(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """largest() by chunks: each chunk's top k, then the top k of those."""
    n, vocab = x.shape
    chunks = -(-vocab // CHUNK)
    padded = F.pad(x, (0, chunks * CHUNK - vocab), value=float("-inf")).view(n, chunks, CHUNK)
    values, ids = padded.topk(k, dim=-1)
    ids += torch.arange(0, chunks * CHUNK, CHUNK, device=x.device).unsqueeze(1)
    values, picked = values.view(n, -1).topk(k, dim=-1)
    return values, ids.view(n, -1).gather(1, picked)


@torch.inference_mode()
def logprob_table(logits: torch.Tensor, rows: list[int], tokens: torch.Tensor | list[int], k: int) -> torch.Tensor:
    """logits [n, vocab] as the model gave them (any float dtype); for each
    of `rows` (row indices), the token it sampled: tokens [len(rows)], an
    integer tensor on the logits' device or a list. -> float64 [len(rows),
    1 + 2k]: the chosen token's logprob, the top k logprobs, their ids.
    float64 holds the float32 logprobs and every token id exactly, so one
    table makes one copy."""
    if rows == list(range(logits.shape[0])):
        picked = logits
    else:
        picked = logits.index_select(0, device_tensor(rows, torch.long, logits.device))
    if not isinstance(tokens, torch.Tensor):
        tokens = device_tensor(tokens, torch.long, logits.device)
    chosen_ids = tokens.long()
    # In float32, as log_softmax of a float copy had it: a bf16 logsumexp rounds.
    norm = torch.logsumexp(picked.float(), -1, keepdim=True)
    values, ids = largest(picked, k) if k else (picked[:, :0], picked[:, :0].long())
    chosen = picked.gather(1, chosen_ids.unsqueeze(1))
    logprobs = torch.cat((chosen, values), 1).float() - norm
    return torch.cat((logprobs.double(), ids.double()), 1)


def read_table(table: Sequence[Sequence[float]], top: list[int], k: int) -> list[TokenLogprobs]:
    """logprob_table's rows on the host, each cut to its own top count."""
    return [(row[0], tuple(int(t) for t in row[1 + k:1 + k + top[i]]), tuple(row[1:1 + top[i]]))
            for i, row in enumerate(table)]


def batch_logprobs(logits: torch.Tensor, rows: list[int], tokens: list[int],
                   top: list[int]) -> list[TokenLogprobs]:
    """For each of `rows`, with the token it sampled and its top count (one copy to the host)."""
    if not rows:
        return []
    k = max(top)
    return read_table(logprob_table(logits, rows, tokens, k).tolist(), top, k)
