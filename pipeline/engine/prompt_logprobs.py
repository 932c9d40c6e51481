"""vLLM's prompt_logprobs: for each prompt token after the first, its
logprob under the model given the tokens before it, its rank, and the top
k of that distribution (the model's own, as the output's logprobs).

Position p's logits score prompt token p + 1, so a prefill chunk over
positions [start, end) scores tokens start + 1 .. end (none past the
prompt's last). They come from the chunk's hidden states in slices of
rows: a row's logits are a vocabulary wide, and 2,048 rows of 150k floats
would be 1.2 GB. Each slice is read to the host at once, which waits for
the device: a cost only such requests' steps pay.

Every prompt position must be computed, so such a request takes nothing
from the prefix cache (engine/prefix_cache.py), as in vLLM, and a step
with one of its prompt chunks runs eagerly rather than as a captured mixed
step, whose graph keeps only the sampled rows (engine/runner.py).
"""

from __future__ import annotations

import torch

from pipeline.engine.logprobs import logprob_table, read_table

# (the token, its logprob, its rank: how many tokens are at least as likely,
# itself included, as vLLM counts it (1: the likeliest), the top k ids, their
# logprobs), per prompt token from the second on.
PromptLogprob = tuple[int, float, int, tuple[int, ...], tuple[float, ...]]

SLICE_ROWS = 256


@torch.inference_mode()
def chunk_prompt_logprobs(model: torch.nn.Module, hidden: torch.Tensor, first_row: int, start: int, end: int,
                          prompt: list[int], k: int) -> dict[int, PromptLogprob]:
    """hidden rows first_row, ... are a chunk's positions start .. end - 1
    of a prompt (its token ids); -> {position of the scored token: its entry}."""
    out: dict[int, PromptLogprob] = {}
    last = min(end, len(prompt) - 1)   # the last position whose next token is the prompt's
    for lo in range(start, last, SLICE_ROWS):
        hi = min(lo + SLICE_ROWS, last)
        rows = hidden[first_row + lo - start:first_row + hi - start]
        logits = model.logits(rows).float()
        targets = torch.tensor(prompt[lo + 1:hi + 1], dtype=torch.long, device=logits.device)
        table = logprob_table(logits, list(range(hi - lo)), targets, k)
        ranks = (logits >= logits.gather(1, targets.unsqueeze(1))).sum(-1)
        host = torch.cat((table, ranks.double().unsqueeze(1)), 1).tolist()
        for i, (row, (logprob, ids, values)) in enumerate(zip(host, read_table([r[:-1] for r in host],
                                                                               [k] * len(host), k))):
            out[lo + i + 1] = (prompt[lo + i + 1], logprob, int(row[-1]), ids, values)
    return out
