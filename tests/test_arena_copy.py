"""The arena read path's copy kernel under Triton's interpreter: it copies
exactly the words its descriptor names (source, destination, count), for
sizes that leave a partial last block and for runs longer than one sweep of
the programs, and nothing past them. (Its graph replays run on the GPU box:
scripts/gpu_arena_bench.py checks every handoff's bytes.)"""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed: the arena copy kernel is a CUDA-only extra", allow_module_level=True)
import test_kernels  # noqa: E402,F401  (sets TRITON_INTERPRET=1 before triton loads)

from pipeline.kernels import arena_copy  # noqa: E402


def descriptor(src: torch.Tensor, src_word: int, dst: torch.Tensor, words: int) -> torch.Tensor:
    row = torch.zeros(arena_copy.DESCRIPTOR_FIELDS, dtype=torch.int64)
    row[arena_copy.SRC] = src.data_ptr() + src_word * arena_copy.WORD
    row[arena_copy.DST] = dst.data_ptr()
    row[arena_copy.WORDS] = words
    return row


@pytest.mark.parametrize("offset_words, n_words, programs", [(0, 5, 4), (16, arena_copy.BLOCK + 3, 4),
                                                             (3, 5 * arena_copy.BLOCK - 1, 2), (7, 0, 3)])
def test_copy_by_descriptor_moves_exactly_the_named_words(offset_words, n_words, programs):
    gen = torch.Generator().manual_seed(n_words)
    arena = torch.randint(-2**62, 2**62, (offset_words + n_words + 7,), generator=gen, dtype=torch.int64)
    out = torch.zeros(n_words + 3, dtype=torch.int64)     # 3 words past the copy stay untouched
    arena_copy.copy_by_descriptor(descriptor(arena, offset_words, out, n_words), programs)
    assert torch.equal(out[:n_words], arena[offset_words:offset_words + n_words])
    assert torch.equal(out[n_words:], torch.zeros(3, dtype=torch.int64))


def test_copy_by_descriptor_keeps_bf16_bits():
    embedding = torch.randn(6, 8).to(torch.bfloat16)
    out = torch.zeros_like(embedding)
    arena_copy.copy_by_descriptor(descriptor(embedding.view(-1).view(torch.int64), 0, out,
                                             embedding.numel() * 2 // arena_copy.WORD), 2)
    assert torch.equal(out, embedding)


def test_a_row_described_by_the_graph_copier_drives_the_kernel():
    """GraphCopier.describe writes the row layout the kernel reads (its CUDA
    graphs themselves only run on the GPU box)."""
    from pipeline.arena.graph_copy import GraphCopier

    copier = object.__new__(GraphCopier)      # the row table alone, no CUDA
    table = torch.zeros(3, arena_copy.DESCRIPTOR_FIELDS, dtype=torch.int64)
    copier._cells = memoryview(table.numpy().reshape(-1))
    arena = torch.arange(40, dtype=torch.int64)
    out = torch.zeros(6, dtype=torch.int64)
    copier.describe(2, arena.data_ptr() + 9 * arena_copy.WORD, out.data_ptr(), 6 * arena_copy.WORD)
    assert table[:2].eq(0).all()                      # other rows untouched
    arena_copy.copy_by_descriptor(table[2], 2)
    assert torch.equal(out, arena[9:15])
    assert GraphCopier.accepts(48, out) and not GraphCopier.accepts(44, out) and not GraphCopier.accepts(8, out[::2])
