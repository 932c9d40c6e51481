"""A grammar's token bitmask applied to float logits in one pass, in place.

Unfused (engine/grammar.py's unpack_bitmask, then masked_fill) a step
expands the int32 words to a [rows, vocab] bool tensor through an int32
intermediate 32 times the words' size: several passes over tens of MB at
batch 32 and a 150k vocabulary. Here each program reads one block's words
and writes -inf only where a token's bit is clear; an allowed token's logit
is not read or written at all.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _bitmask_kernel(logits_ptr, words_ptr, rows_ptr, logits_stride, words_stride, vocab, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < vocab
    row = tl.load(rows_ptr + i)
    words = tl.load(words_ptr + i * words_stride + cols // 32, mask=inside, other=-1)
    # & 1 after the shift: an arithmetic shift of a word with bit 31 set fills with ones above it.
    allowed = ((words >> (cols % 32)) & 1) != 0
    tl.store(logits_ptr + row * logits_stride + cols, float("-inf"), mask=inside & ~allowed)


def apply_bitmask(logits: torch.Tensor, words: torch.Tensor, rows: torch.Tensor) -> None:
    """Rows `rows` of float logits [n, vocab], in place: token t of row
    rows[i] becomes -inf unless bit t % 32 of words[i, t // 32] is set;
    words int32 [len(rows), >= ceil(vocab / 32)]."""
    vocab = logits.shape[1]
    if words.dtype != torch.int32 or not logits.is_floating_point():
        raise ValueError("apply_bitmask wants float logits and int32 words")
    if logits.stride(1) != 1 or words.stride(1) != 1 or words.shape[1] * 32 < vocab \
            or words.shape[0] != len(rows):
        raise ValueError(f"apply_bitmask wants row-major logits and [{len(rows)}, {(vocab + 31) // 32}] words")
    if not len(rows):
        return
    _bitmask_kernel[(len(rows), triton.cdiv(vocab, BLOCK))](
        logits, words, rows, logits.stride(0), words.stride(0), vocab, BLOCK=BLOCK, num_warps=4)
