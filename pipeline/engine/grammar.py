"""Structured output: each request with a grammar (llguidance's, e.g. from a
JSON schema) gets a matcher that says which tokens may come next; a step
fills the masks of all such rows in one parallel call (llguidance's Rust
executor, off the GIL) and applies them to the logits as one tensor
operation (on CUDA, kernels/bitmask.py's one pass); after sampling the
matchers consume their rows' tokens in one parallel call.

A mask depends only on the tokens its matcher has consumed, so the engine
fills the step's masks while the device runs the forward (Grammars.fill,
before the step's first read of the logits), into one reused host buffer
(pinned where CUDA is) that reaches the device in a queued copy; the bits
are unpacked on the device.

llguidance rather than xgrammar: its wheel has no dependency on transformers
(which stays a test-only oracle here), it computes masks on the CPU (its
authors report tens of microseconds a row; scripts/gpu_sampling_cost.py is
to measure the step cost here), and it builds its tokenizer from the
checkpoint's tokenizer.json, as ours does.
"""

from __future__ import annotations

import torch

from pipeline.engine.small_copies import device_tensor, steady_tensor

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
        # One step's masks, reused: pinned so the copy to a GPU can be queued.
        self._bitmask = torch.empty((0, (vocab_size + 31) // 32), dtype=torch.int32)
        self._copied: torch.cuda.Event | None = None   # recorded after the last queued copy out of it

    def matcher(self, grammar: str):
        matcher = self._llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid grammar: {matcher.get_error()}")
        return matcher

    def fill(self, matchers: list) -> GrammarMasks | None:
        """The masks of one step's rows, matchers[i] being row i's (None: not
        constrained); None if no row is. Host work only: it overlaps the
        forward when called before anything waits on the logits."""
        import llguidance.torch as llt

        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return None
        bitmask = self._buffer(len(rows))
        llt.fill_next_token_bitmask_par(self.executor, [(matchers[r], i) for i, r in enumerate(rows)], bitmask)
        return GrammarMasks(bitmask, rows, self)

    def consume(self, pairs: list[tuple]) -> None:
        """Each (matcher, token) pair's matcher takes its token, all in one
        parallel call (the executor's threads, off the GIL): one at a time
        they cost about 14 us each on the host, after the step's wait. A
        matcher that refuses its token is left in its error state, which
        stops its request."""
        if pairs:
            self.executor.consume_token_par(pairs)

    def _buffer(self, rows: int) -> torch.Tensor:
        if self._copied is not None:
            self._copied.synchronize()   # the last step's copy out of the buffer has finished
            self._copied = None
        if self._bitmask.shape[0] < rows:
            self._bitmask = torch.empty((max(rows, 2 * self._bitmask.shape[0]), self._bitmask.shape[1]),
                                        dtype=torch.int32, pin_memory=torch.cuda.is_available())
        return self._bitmask[:rows]

    def send(self, bitmask: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The buffer's rows on `device`; on CUDA a queued copy, after which
        the next fill waits before writing the buffer again."""
        if device.type != "cuda":
            return bitmask.to(device)
        out = bitmask.to(device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return out


class GrammarMasks:
    """One step's filled masks: bitmask row i is row rows[i]'s of the batch."""

    def __init__(self, bitmask: torch.Tensor, rows: list[int], grammars: Grammars) -> None:
        self.bitmask = bitmask
        self.rows = rows
        self.grammars = grammars

    def apply(self, logits: torch.Tensor) -> None:
        """Mask float logits [n, vocab] in place: each constrained row keeps only what its matcher allows."""
        words = self.grammars.send(self.bitmask, logits.device)
        if logits.is_cuda:
            from pipeline.kernels.bitmask import apply_bitmask   # imports triton: CUDA only

            apply_bitmask(logits, words, steady_tensor("masked_rows", tuple(self.rows), torch.long, logits.device))
            return
        allowed = unpack_bitmask(words, logits.shape[1])
        if self.rows == list(range(logits.shape[0])):
            logits.masked_fill_(~allowed, float("-inf"))
            return
        index = device_tensor(self.rows, torch.long, logits.device)
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """int32 [n, words] (bit j of word w: token 32 w + j) -> bool [n, vocab]."""
    bits = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    allowed = (bitmask.unsqueeze(-1) >> bits) & 1
    return allowed.reshape(bitmask.shape[0], -1)[:, :vocab].bool()
