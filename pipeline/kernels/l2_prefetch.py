"""Weights streamed into L2 while the decode step's small kernels run.

A batch-1 decode step reads every weight once, and its short projections
(qkv: 10.5 MB, o_proj: 8.4 MB on the 3B shape) read at about 2.2 TB/s, half
the copy bandwidth: too short a kernel to fill the memory system. Between
them the step runs latency-bound kernels (rotary, attention and its merge,
add + RMSNorm) during which HBM idles. Launched with PDL right after a
projection, this kernel asks L2 for the *next* projection's weight
(`prefetch.global.L2::evict_last`, one per 128-byte line) while those
kernels run, so that projection reads from L2.

Ordering: the prefetches touch only weights, which no kernel writes, so
they may run before the wait. The kernel releases the next kernel first and
waits before it ends: it completes only after its predecessor has, which
keeps the chain's ordering transitive (pipeline/kernels/dependent_launch.py).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from pipeline.kernels import dependent_launch

LINE_BYTES = 128
_LINES_PER_PROGRAM = 1024


def max_bytes() -> int:
    """The largest next weight worth prefetching; 0: off. An experiment, off
    unless EPD_L2_PREFETCH_MB is set."""
    return int(float(os.environ.get("EPD_L2_PREFETCH_MB", "0")) * (1 << 20))


@triton.jit
def _l2_prefetch_kernel(w_ptr, n_lines, LINES: tl.constexpr, LINE: tl.constexpr, USE_GDC: tl.constexpr):
    idx = tl.program_id(0) * LINES + tl.arange(0, LINES)
    idx = tl.where(idx < n_lines, idx, 0)
    ptrs = w_ptr + idx.to(tl.int64) * LINE
    tl.inline_asm_elementwise("mov.u32 $0, 0;\n\tprefetch.global.L2::evict_last [$1];", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


def prefetch(weight: torch.Tensor) -> None:
    """Launch the prefetch of `weight` (contiguous); only inside a PDL
    launching block, where it overlaps the kernels after it."""
    if not dependent_launch.is_on():
        return
    n_lines = weight.numel() * weight.element_size() // LINE_BYTES
    line = LINE_BYTES // weight.element_size()
    _l2_prefetch_kernel[(triton.cdiv(n_lines, _LINES_PER_PROGRAM),)](
        weight, n_lines, LINES=_LINES_PER_PROGRAM, LINE=line, num_warps=4,
        **dependent_launch.launch_options())


class NextWeights:
    """Which projection follows which, learned from the order ops.linear
    sees them in (every forward runs a model's projections in one order;
    a graph's warm-up run teaches its capture), and which of those followers
    are small enough to prefetch. One per process: the layer ops are made
    anew for every captured graph."""

    def __init__(self) -> None:
        self._follower: dict[int, torch.Tensor] = {}
        self._last: int | None = None

    def after(self, weight: torch.Tensor, limit: int) -> torch.Tensor | None:
        """Note that `weight` ran; the weight to prefetch after it, if any."""
        key = weight.data_ptr()
        if self._last is not None and self._last != key:
            self._follower.setdefault(self._last, weight)
        self._last = key
        follower = self._follower.get(key)
        if follower is None or not follower.is_contiguous():
            return None
        return follower if follower.numel() * follower.element_size() <= limit else None


ORDER = NextWeights()
