"""Copy bytes between two device addresses read from a descriptor at run time.

The arena read path replays one captured CUDA graph per copy (see
pipeline/arena/graph_copy.py). A graph's kernel arguments are fixed at
capture, so this kernel takes none that vary: it loads the source address,
the destination address and the number of 8-byte words from a descriptor
in pinned host memory, which the host fills just before the replay.

Why a kernel rather than `Tensor.copy_`: on the 2xH200 box, queueing
`copy_` (or a Triton launch) from Python costs 25-80 us of host time per
handoff under the sandbox, and the copy engine moved 8 MiB from the other
GPU at about 183 GB/s; a graph replay is one launch, and the
multiprocessors read peer memory at more of the link's bandwidth
(docs/benchmarks.md, issue 3).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

WORD = 8           # bytes per element moved
BLOCK = 2048       # words per program per iteration (16 KiB)
PROGRAMS = 256     # fixed at capture; small copies leave most programs idle
SRC, DST, WORDS = 0, 1, 2    # descriptor fields (int64 each)
DESCRIPTOR_FIELDS = 4        # padded to 32 bytes


@triton.jit
def _copy_by_descriptor_kernel(descriptor_ptr, BLOCK: tl.constexpr):
    src = tl.load(descriptor_ptr).to(tl.pointer_type(tl.int64))
    dst = tl.load(descriptor_ptr + 1).to(tl.pointer_type(tl.int64))
    n_words = tl.load(descriptor_ptr + 2)
    for start in range(tl.program_id(0) * BLOCK, n_words, tl.num_programs(0) * BLOCK):
        idx = start + tl.arange(0, BLOCK)
        mask = idx < n_words
        tl.store(dst + idx, tl.load(src + idx, mask=mask), mask=mask)


class Address:
    """A raw pointer in the form Triton takes kernel pointers (an object with
    data_ptr and dtype), for a descriptor row in pinned host memory."""

    def __init__(self, address: int) -> None:
        self.address = address
        self.dtype = torch.int64

    def data_ptr(self) -> int:
        return self.address


def copy_by_descriptor(descriptor: torch.Tensor | Address, programs: int = PROGRAMS) -> None:
    """Queue the copy that `descriptor` (int64 [src, dst, words, pad]) names,
    on the current stream. Captured into a graph by GraphCopier; called
    directly by tests."""
    _copy_by_descriptor_kernel[(programs,)](descriptor, BLOCK=BLOCK, num_warps=8)
