#!/usr/bin/env python3
"""The batch-1 decode projections of a Qwen2.5-VL-3B-shaped LM (bf16, main's
kernels and configs: q/k/v with the rotary epilogue, o_proj, gate_up with
the SiLU epilogue, down), each launched --warmup times and then once more,
for Nsight Compute to profile the last round (GPU box only, not in
CI). Kernels run one at a time under the profiler, with caches flushed, so
what it reports is each kernel alone: DRAM throughput, occupancy, and where
its warps stall.

    ncu --nvtx --nvtx-include "profiled/" --section SpeedOfLight --section Occupancy \
        --section LaunchStats --section WarpStateStats -o $OUT/gemv python3 scripts/gpu_gemv_ncu.py

The last round also runs cuBLAS on the q/k/v shape and a plain read (a sum)
of the q/k/v weight's bytes, for comparison.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from pipeline.kernels.gemv import gemv, gemv_silu_mul  # noqa: E402
from pipeline.kernels.gemv_rotary import gemv_rotary_kv  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 2048, 16, 2, 128, 11008


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rows", type=int, default=1)
    args = p.parse_args()
    device = torch.device("cuda:0")
    torch.manual_seed(0)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device=device) * scale).to(torch.bfloat16)

    rows = args.rows
    qkv_rows = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    qkv_w, qkv_b = randn(qkv_rows, HIDDEN, scale=0.02), randn(qkv_rows)
    o_w, gate_up_w, down_w = randn(HIDDEN, HIDDEN, scale=0.02), randn(2 * INTERMEDIATE, HIDDEN, scale=0.02), \
        randn(HIDDEN, INTERMEDIATE, scale=0.01)
    x, mlp_x = randn(rows, HIDDEN), randn(rows, INTERMEDIATE)
    angles = torch.rand(rows, HEAD_DIM // 2, device=device) * 100
    angles = torch.cat([angles, angles], -1)
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    caches = [randn(4096, KV_HEADS, HEAD_DIM) for _ in range(2)]
    slots = torch.arange(rows, device=device) * 7
    for round_ in range(args.warmup + 1):
        last = round_ == args.warmup
        if last:   # the round profiled (ncu --nvtx --nvtx-include profiled/)
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push("profiled")
        gemv_rotary_kv(x, qkv_w, qkv_b, cos, sin, HEADS, *caches, slots)
        gemv(x, o_w)
        gemv_silu_mul(x, gate_up_w)
        gemv(mlp_x, down_w)
        # For comparison: cuBLAS on q/k/v, and a plain read of as many bytes.
        torch.nn.functional.linear(x, qkv_w, qkv_b)
        qkv_w.sum(dtype=torch.float32)
        if last:
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
