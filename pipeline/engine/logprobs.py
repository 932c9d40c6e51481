"""Log-probabilities for the requests that ask for them: the chosen token's
and the top k of the model's own distribution (before temperature, bias,
penalties or any cut, as the common servers return by default).

log_softmax(x) is x - logsumexp(x), and subtracting a row's constant keeps
the order, so the batch takes one top-k of the logits as they are, one
logsumexp a row and one gather for the chosen tokens, instead of a full
log-probability table. The chosen tokens may still be on the device
(engine/choose.py queues this before the step's one wait), and the table
reaches the host in the same copy as the tokens.

(A two-stage top-k, by 2,048-token chunks and then over the chunks' picks,
was no faster on the H200 at batch 32: 0.26 and 0.13 ms in two runs against
torch's whole-row 0.115 and 0.131; docs/benchmarks.md.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pipeline.engine.small_copies import device_tensor, steady_tensor

# (the chosen token's logprob, the top k ids, their logprobs), per token.
TokenLogprobs = tuple[float, tuple[int, ...], tuple[float, ...]]


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
        picked = logits.index_select(0, steady_tensor("logprob_rows", tuple(rows), torch.long, logits.device))
    if not isinstance(tokens, torch.Tensor):
        tokens = device_tensor(tokens, torch.long, logits.device)
    chosen_ids = tokens.long()
    # In float32, as log_softmax of a float copy had it: a bf16 logsumexp rounds.
    norm = torch.logsumexp(picked.float(), -1, keepdim=True)
    values, ids = picked.topk(k, dim=-1) if k else (picked[:, :0], picked[:, :0].long())
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
