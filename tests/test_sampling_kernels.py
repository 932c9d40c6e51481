"""The penalties kernel (kernels/penalties.py) on the CPU under Triton's
interpreter against the torch path it replaces on CUDA
(engine/penalties.penalise_rows_reference): equal bit for bit, rows and
pool rows out of order, a vocabulary that ends inside a block. The
interpreter set-up is test_kernels.py's, shared by importing it."""

from __future__ import annotations

import pytest
import torch

import test_kernels  # noqa: F401  (sets TRITON_INTERPRET=1 before triton loads)
from pipeline.engine.penalties import penalise_rows_reference
from pipeline.kernels.penalties import BLOCK, penalise_rows


def test_penalties_kernel_equals_the_torch_path():
    gen = torch.Generator().manual_seed(0)
    vocab = 2 * BLOCK + 37
    logits = torch.randn(5, vocab, generator=gen) * 4
    counts = torch.randint(0, 3, (6, vocab), generator=gen).float() * (torch.rand(6, vocab, generator=gen) < 0.1)
    seen = (counts > 0) | (torch.rand(6, vocab, generator=gen) < 0.05)
    batch, slots = torch.tensor([4, 0, 2]), torch.tensor([1, 5, 3])
    settings = torch.tensor([[1.3, 0.7, 1.0], [0.4, -1.1, 0.0], [0.25, 0.0, -0.6]])
    ours, theirs = logits.clone(), logits.clone()
    penalise_rows(ours, batch, slots, counts, seen, settings)
    penalise_rows_reference(theirs, batch, slots, counts, seen, settings)
    assert torch.equal(ours, theirs)
    assert torch.equal(ours[[1, 3]], logits[[1, 3]])          # rows outside the batch are untouched
    assert not torch.equal(ours[:, -37:], logits[:, -37:])    # the last, partial block was penalised too


def test_penalties_kernel_refuses_other_dtypes():
    logits = torch.zeros(1, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="float32"):
        penalise_rows(logits, torch.tensor([0]), torch.tensor([0]), torch.zeros(1, 8),
                      torch.zeros(1, 8, dtype=torch.bool), torch.ones(3, 1))


def test_bitmask_kernel_equals_unpack_and_fill():
    from pipeline.engine.grammar import unpack_bitmask
    from pipeline.kernels.bitmask import BLOCK as MASK_BLOCK, apply_bitmask

    gen = torch.Generator().manual_seed(2)
    vocab = 2 * MASK_BLOCK + 45   # the last block and the last word both end early
    logits = torch.randn(4, vocab, generator=gen)
    words = torch.randint(-2**31, 2**31 - 1, (2, (vocab + 31) // 32), generator=gen, dtype=torch.int64).to(torch.int32)
    words[1, 0] = -1   # every bit of a word set, bit 31 (the sign) included
    rows = torch.tensor([3, 1])
    ours, theirs = logits.clone(), logits.clone()
    apply_bitmask(ours, words, rows)
    theirs[rows] = theirs[rows].masked_fill(~unpack_bitmask(words, vocab), float("-inf"))
    assert torch.equal(ours, theirs)
    assert torch.equal(ours[[0, 2]], logits[[0, 2]])    # rows outside the mask are untouched
    assert torch.isinf(ours[3]).any() and torch.equal(ours[1, :32], logits[1, :32])
    with pytest.raises(ValueError, match="int32"):
        apply_bitmask(logits, words.long(), rows)
