"""Log-probabilities for the requests that ask for them: the chosen token's
and the top k of the model's own distribution (before temperature, bias,
penalties or any cut, as the common servers return by default), for the
whole batch in one log_softmax and one topk."""

from __future__ import annotations

import torch

# (the chosen token's logprob, the top k ids, their logprobs), per token.
TokenLogprobs = tuple[float, tuple[int, ...], tuple[float, ...]]
MAX_TOP_LOGPROBS = 20


@torch.inference_mode()
def batch_logprobs(logits: torch.Tensor, rows: list[int], tokens: list[int],
                   top: list[int]) -> list[TokenLogprobs]:
    """logits [n, vocab] as the model gave them; for each of `rows` (row
    indices), with the token it sampled and its top count."""
    if not rows:
        return []
    index = torch.tensor(rows, device=logits.device)
    logprobs = logits[index].float().log_softmax(-1)
    chosen = logprobs.gather(1, torch.tensor(tokens, device=logits.device).unsqueeze(1)).squeeze(1).tolist()
    k = max(top)
    values, ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    values, ids = values.tolist(), ids.tolist()
    return [(chosen[i], tuple(ids[i][:top[i]]), tuple(values[i][:top[i]])) for i in range(len(rows))]
