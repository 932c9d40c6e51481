#!/usr/bin/env python3
"""Does a short decode projection gain from reading its weight before its
grid wait? (issue 14 part 6; GPU box only, not in CI.)

At one row the q/k/v (10.5 MB) and o_proj (8.4 MB) gemvs read at about
2.2 TB/s, against 3.4-3.9 for gate_up and down (session 18), and Nsight
Compute shows their SMs idle for about a third of each kernel's time
(session 24). With programmatic dependent launch a gemv's programs are
resident while the kernel before it runs, but main's gemv waits before it
loads anything. The weight never depends on the kernel before, only x
does. This bench chains, 36 times in one CUDA graph and with PDL, the
add + RMSNorm kernel that precedes q/k/v in a layer and a [N, 2048]
projection of its output (36 different weights, so every read comes from
HBM). The projection runs three ways:
  main      pipeline/kernels/gemv.py at its default config;
  after     a one-shot kernel here: each program loads its 4 x 2048 weight
            rows in one go, after the wait;
  before    the same kernel with the weight loaded before the wait.
`after` against `main` is the one-shot load; `before` against `after` is
reading the weight before the wait. Every way's output must equal
F.linear's within bf16 rounding (a missed wait would show).

    timeout 200 python3 scripts/gpu_gemv_preload_bench.py --json $OUT/preload.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from pipeline.kernels import dependent_launch  # noqa: E402
from pipeline.kernels.gemv import gemv  # noqa: E402
from pipeline.kernels.rmsnorm import add_rms_norm  # noqa: E402

LAYERS, K, BLOCK_N = 36, 2048, 4


@triton.jit
def _one_shot_gemv(x_ptr, w_ptr, out_ptr, N, K: tl.constexpr, BLOCK_N: tl.constexpr, BEFORE: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, K)
    w_ptrs = w_ptr + rn.to(tl.int64)[:, None] * K + rk[None, :]
    if BEFORE:
        w = tl.load(w_ptrs, mask=(rn < N)[:, None], other=0.0, eviction_policy="evict_first")
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    else:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
        w = tl.load(w_ptrs, mask=(rn < N)[:, None], other=0.0, eviction_policy="evict_first")
    x = tl.load(x_ptr + rk).to(tl.float32)
    acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    tl.store(out_ptr + rn, acc.to(out_ptr.dtype.element_ty), mask=rn < N)


def one_shot(x: torch.Tensor, weight: torch.Tensor, before: bool) -> torch.Tensor:
    N = weight.shape[0]
    out = torch.empty((1, N), dtype=x.dtype, device=x.device)
    _one_shot_gemv[(triton.cdiv(N, BLOCK_N),)](x, weight, out, N, K=K, BLOCK_N=BLOCK_N, BEFORE=before,
                                               num_warps=4, launch_pdl=True)
    return out


def chain_us(way: str, weights, norm_weight, x0, replays: int) -> tuple[float, float]:
    """Microseconds per (norm, projection) pair over a graph of 36, and the
    largest error of the last pair's output against F.linear."""
    def step():
        h = x0
        out = None
        for w in weights:
            _, h_norm = add_rms_norm(h, None, norm_weight, 1e-6)
            out = gemv(h_norm, w) if way == "main" else one_shot(h_norm, w, before=way == "before")
            h = out[:, :K]
        return h_norm, out
    with dependent_launch.launching(True):
        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            last_in, last_out = step()
    graph.replay()
    torch.cuda.synchronize()
    error = (last_out.float() - F.linear(last_in, weights[-1]).float()).abs().max().item()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / replays / LAYERS, error


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--json", type=Path)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--replays", type=int, default=200)
    args = p.parse_args()
    device = torch.device("cuda:0")
    dependent_launch.allow(dependent_launch.supported(device))
    if not dependent_launch.supported(device):
        print("PDL not supported here", flush=True)
        return 1
    report: dict = {"device": torch.cuda.get_device_name(0), "results": {}}
    gen = torch.Generator(device=device).manual_seed(0)
    norm_weight = torch.ones(K, device=device, dtype=torch.bfloat16)
    x0 = torch.randn(1, K, device=device, generator=gen).bfloat16()
    failed = []
    for name, N in (("qkv", 2560), ("o_proj", 2048)):
        weights = [(torch.randn(N, K, device=device, generator=gen) * K ** -0.5).bfloat16() for _ in range(LAYERS)]
        for r in range(args.rounds):
            for way in ("main", "after", "before"):
                us, error = chain_us(way, weights, norm_weight, x0, args.replays)
                report["results"].setdefault(name, {}).setdefault(way, []).append(us)
                if error > 0.05:
                    failed.append(f"{name}.{way}: max error {error:.3g} against F.linear")
                print(f"round {r} {name} {way}: {us:.3f} us a norm + projection pair (error {error:.3g})", flush=True)
        del weights
    report["median_us"] = {name: {way: sorted(v)[len(v) // 2] for way, v in ways.items()}
                           for name, ways in report["results"].items()}
    report["failed"] = failed
    print(json.dumps(report["median_us"], indent=1), "failed:", failed, flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
