#!/usr/bin/env python3
"""Sweep the arena copy kernel's launch shape (programs, words per program,
warps) on the GPU box: 2 and 8 MiB copies from cuda:0's memory into cuda:1
(peer reads, as a generator reads an encoder's arena) and within cuda:0, each
timed by CUDA events over graph replays of the descriptor kernel.

    python scripts/gpu_copy_kernel_sweep.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import triton  # noqa: E402

from pipeline.kernels import arena_copy  # noqa: E402


def time_copy(src: torch.Tensor, dst: torch.Tensor, programs: int, block: int, warps: int) -> float:
    descriptor = torch.zeros(arena_copy.DESCRIPTOR_FIELDS, dtype=torch.int64, pin_memory=True)
    descriptor[arena_copy.SRC], descriptor[arena_copy.DST] = src.data_ptr(), dst.data_ptr()
    descriptor[arena_copy.WORDS] = src.numel() * src.element_size() // arena_copy.WORD
    address = arena_copy.Address(descriptor.data_ptr())

    def launch():
        arena_copy._copy_by_descriptor_kernel[(programs,)](address, BLOCK=block, num_warps=warps)

    with torch.cuda.device(dst.device):
        ms = triton.testing.do_bench(launch, warmup=20, rep=100, return_mode="median")
    assert torch.equal(dst.view(torch.uint8), src.view(torch.uint8).to(dst.device))
    return ms * 1000


def main() -> int:
    peer = torch.cuda.device_count() > 1
    for mib in (2, 8):
        src = torch.randint(0, 255, (mib << 20,), dtype=torch.uint8, device="cuda:0")
        targets = [("same GPU", torch.empty_like(src))]
        if peer:
            targets.append(("peer", torch.empty(mib << 20, dtype=torch.uint8, device="cuda:1")))
            # Cross-device copies enable peer access, both ways.
            torch.empty(1, device="cuda:1").copy_(torch.empty(1, device="cuda:0"))
            torch.empty(1, device="cuda:0").copy_(torch.empty(1, device="cuda:1"))
        for name, dst in targets:
            results = []
            for programs in (128, 256, 528, 1056):
                for block in (1024, 2048, 4096):
                    for warps in (4, 8, 16):
                        dst.zero_()
                        results.append((time_copy(src, dst, programs, block, warps), programs, block, warps))
            results.sort()
            current = [r for r in results if r[1:] == (arena_copy.PROGRAMS, arena_copy.BLOCK, 8)][0]
            print(f"{mib} MiB {name}: current (programs {current[1]}, block {current[2]}, warps 8) "
                  f"{current[0]:.1f} us = {(mib << 20) / current[0] / 1e3:.0f} GB/s; best: " + "; ".join(
                      f"{us:.1f} us p{p} b{b} w{w}" for us, p, b, w in results[:4]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
