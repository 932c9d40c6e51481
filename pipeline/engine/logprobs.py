"""Log-probabilities for the requests that ask for them: the chosen token's
and the top k of the model's own distribution (before temperature, bias,
penalties or any cut, as the common servers return by default).

log_softmax(x) is x - logsumexp(x), and subtracting a row's constant keeps
the order, so the batch takes one topk of the logits as they are, one
logsumexp a row and one gather for the chosen tokens, instead of a full
log-probability table; the results reach the host in one copy.
"""

from __future__ import annotations

import torch

from pipeline.engine.small_copies import device_tensor

# (the chosen token's logprob, the top k ids, their logprobs), per token.
TokenLogprobs = tuple[float, tuple[int, ...], tuple[float, ...]]
MAX_TOP_LOGPROBS = 20


@torch.inference_mode()
def batch_logprobs(logits: torch.Tensor, rows: list[int], tokens: list[int],
                   top: list[int]) -> list[TokenLogprobs]:
    """logits [n, vocab] as the model gave them (any float dtype); for each
    of `rows` (row indices), with the token it sampled and its top count."""
    if not rows:
        return []
    index, chosen_ids = device_tensor([rows, tokens], torch.long, logits.device)
    picked = logits if rows == list(range(logits.shape[0])) else logits.index_select(0, index)
    # In float32, as log_softmax of a float copy had it: a bf16 logsumexp rounds.
    norm = torch.logsumexp(picked.float(), -1, keepdim=True)
    k = max(top)
    values, ids = picked.topk(k, dim=-1) if k else (picked[:, :0], picked[:, :0].long())
    chosen = picked.gather(1, chosen_ids.unsqueeze(1))
    # float64 holds the float32 logprobs and every token id exactly: one table, one copy to the host.
    logprobs = torch.cat((chosen, values), 1).float() - norm
    table = torch.cat((logprobs.double(), ids.double()), 1).tolist()
    return [(row[0], tuple(int(t) for t in row[1 + k:1 + k + top[i]]), tuple(row[1:1 + top[i]]))
            for i, row in enumerate(table)]
