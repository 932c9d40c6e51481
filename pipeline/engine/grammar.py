"""Structured output: each request with a grammar (llguidance's, e.g. from a
JSON schema) gets a matcher that says which tokens may come next; a step
fills the masks of all such rows in one parallel call (llguidance's Rust
executor, off the GIL) and applies them to the logits as one tensor
operation; after sampling each matcher consumes its row's token.

llguidance rather than xgrammar: its wheel has no dependency on transformers
(which stays a test-only oracle here), it computes masks on the CPU (its
authors report tens of microseconds a row; scripts/gpu_sampling_cost.py is
to measure the step cost here), and it builds its tokenizer from the
checkpoint's tokenizer.json, as ours does.
"""

from __future__ import annotations

import torch

GRAMMAR_LIBRARY = "llguidance"


class GrammarError(ValueError):
    """A grammar the matcher refuses; the message says why."""


class Grammars:
    """Matchers for one tokenizer and vocabulary (the model's, which may be
    larger than the tokenizer's: the extra ids are never allowed)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        import llguidance

        self._llg = llguidance
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                eos_token=list(eos_token_ids) or None)
        self.executor = llguidance.LLExecutor()

    def matcher(self, grammar: str):
        matcher = self._llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid grammar: {matcher.get_error()}")
        return matcher

    def apply(self, logits: torch.Tensor, rows: list[int], matchers: list) -> None:
        """Mask logits [n, vocab] in place: row rows[i] keeps only what matchers[i] allows."""
        import llguidance.torch as llt

        words = (self.vocab_size + 31) // 32
        bitmask = torch.full((len(rows), words), -1, dtype=torch.int32)
        llt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
        allowed = unpack_bitmask(bitmask.to(logits.device), logits.shape[1])
        index = torch.tensor(rows, device=logits.device)
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 [n, words] (bit j of word w: token 32 w + j) -> bool [n, vocab]."""
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = (bitmask.unsqueeze(-1) >> bits) & 1
    return allowed.reshape(bitmask.shape[0], -1)[:, :vocab].bool()
