#!/usr/bin/env python3
"""cuBLAS (F.linear) against the Triton small-M matmul (pipeline/kernels/gemv.py)
on the decode projections of a Qwen2.5-VL-3B-shaped LM, bf16 (run on the GPU
box, not in CI):

    timeout 300 python scripts/gpu_gemv_bench.py --json gemv_bench.json

For each shape (qkv with bias, o_proj, gate_up, down, lm_head) and M rows,
every candidate config is checked against F.linear (bf16 tolerance, and the
graph's output equal to the eager one), then timed as a CUDA graph of 36
back-to-back launches over a rotating set of weights larger than 8x the L2
(so every launch reads its weight from HBM, as in a decode step), replayed
--replays times; the median replay / 36 is the time per launch. A config
that fails to compile or run, or gives a wrong result, is recorded and
skipped. Prints a table of the best config per (shape, M) and the step
time saved at each M (36 x per layer shapes, lm_head once) by using the
faster of the two per shape; writes every measurement to --json after
each shape, so a timeout keeps what finished.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from pipeline.kernels import dependent_launch  # noqa: E402
from pipeline.kernels.gemv import GemvConfig, gemv  # noqa: E402

LAYERS = 36
TOL = dict(atol=2e-2, rtol=2e-2)  # about one bf16 rounding step at |y| ~ 1-2


@dataclass(frozen=True)
class Shape:
    name: str
    N: int
    K: int
    bias: bool
    per_step: int  # launches per decode step


SHAPES = [Shape("qkv", 2560, 2048, True, LAYERS), Shape("o_proj", 2048, 2048, False, LAYERS),
          Shape("gate_up", 22016, 2048, False, LAYERS), Shape("down", 2048, 11008, False, LAYERS),
          Shape("lm_head", 151936, 2048, False, 1)]


def candidates(M: int, K: int) -> list[GemvConfig]:
    """~10-17 configs per (shape, M): FMA modes while their accumulators fit
    registers, tensor-core dot for every M, split-K only for long K."""
    C = GemvConfig
    grid = []
    if M <= 2:
        grid += [C(block_n=4, block_k=512, mode="defer"), C(block_n=8, block_k=256, mode="defer"),
                 C(block_n=8, block_k=512, mode="defer", num_stages=3), C(block_n=16, block_k=256, mode="defer"),
                 C(block_n=32, block_k=256, mode="defer", num_warps=8),
                 C(block_n=8, block_k=256, mode="defer", num_stages=1)]
    if M <= 8:
        grid += [C(block_n=8, block_k=256, mode="reduce"), C(block_n=16, block_k=256, mode="reduce"),
                 C(block_n=16, block_k=128, mode="reduce", num_stages=6)]
    if 2 < M <= 8:
        grid += [C(block_n=4, block_k=512, mode="reduce"), C(block_n=8, block_k=512, mode="reduce", num_stages=3)]
    grid += [C(block_n=16, block_k=256, mode="dot"), C(block_n=32, block_k=256, mode="dot"),
             C(block_n=32, block_k=128, mode="dot", num_stages=6), C(block_n=64, block_k=128, mode="dot"),
             C(block_n=64, block_k=256, mode="dot", num_warps=8, num_stages=3)]
    if M > 8:
        grid += [C(block_n=16, block_k=128, mode="dot", num_stages=6),
                 C(block_n=128, block_k=128, mode="dot", num_warps=8, num_stages=3)]
    if K >= 4096:
        grid += [C(block_n=16, block_k=256, mode="dot", split_k=2), C(block_n=16, block_k=256, mode="dot", split_k=4)]
        if M <= 8:
            grid += [C(block_n=16, block_k=256, mode="defer" if M <= 2 else "reduce", split_k=2)]
    return grid


def label(cfg: GemvConfig) -> str:
    return f"{cfg.mode} n{cfg.block_n} k{cfg.block_k} split{cfg.split_k} w{cfg.num_warps} st{cfg.num_stages}"


def graph_time_us(launch, replays: int) -> tuple[float, torch.Tensor]:
    """Captures launch(0..LAYERS-1) in one CUDA graph, replays it; returns the
    median replay time per launch and the graph's output of launch 0."""
    for i in range(2):  # compiled, cuBLAS handles made, before capture
        launch(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [launch(i) for i in range(LAYERS)]
    graph.replay()
    graph.replay()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    for start, end in zip(starts, ends):
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    ms = sorted(s.elapsed_time(e) for s, e in zip(starts, ends))
    first = outs[0].clone()
    del graph, outs
    return ms[len(ms) // 2] * 1e3 / LAYERS, first


def make_operands(shape: Shape, l2_bytes: int):
    """Rotating weights (and biases) totalling at least 8x the L2, made on the GPU."""
    weight_bytes = shape.N * shape.K * 2
    count = min(LAYERS, max(2, math.ceil(8 * l2_bytes / weight_bytes)))
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [(torch.randn(shape.N, shape.K, device="cuda", generator=gen) * shape.K ** -0.5).bfloat16()
               for _ in range(count)]
    biases = [(0.1 * torch.randn(shape.N, device="cuda", generator=gen)).bfloat16() if shape.bias else None
              for _ in range(count)]
    return weights, biases


def measure(shape: Shape, x: torch.Tensor, weights, biases, cfg: GemvConfig | None, replays: int) -> dict:
    """One config (None: F.linear) at one M: correctness, then timing."""
    count = len(weights)
    if cfg is None:
        def launch(i):
            return F.linear(x, weights[i % count], biases[i % count])
    else:
        def launch(i):
            return gemv(x, weights[i % count], biases[i % count], cfg)
    want = F.linear(x, weights[0], biases[0]).float()
    eager = launch(0)
    err = (eager.float() - want).abs().max().item()
    if not torch.allclose(eager.float(), want, **TOL):
        return dict(error=f"wrong result: max abs error {err:.3g} against F.linear")
    us, first = graph_time_us(launch, replays)
    # The Triton kernels are deterministic, so a captured launch should equal
    # the eager one bit for bit; cuBLAS may pick another algorithm under capture.
    graph_exact = torch.equal(first, eager)
    if not graph_exact and not torch.allclose(first.float(), want, **TOL):
        return dict(error="graph replay output differs from F.linear")
    M = x.shape[0]
    nbytes = 2 * (shape.N * shape.K + M * shape.K + M * shape.N + (shape.N if shape.bias else 0))
    return dict(us=round(us, 3), tbps=round(nbytes / us / 1e6, 3), max_abs_err=err, graph_exact=graph_exact)


def context_alive() -> bool:
    """After an error: False when the CUDA context itself is broken (an
    illegal address poisons every later call), so the run must stop."""
    try:
        torch.cuda.synchronize()
        return True
    except RuntimeError:
        return False


def bench_shape_m(shape: Shape, M: int, weights, biases, replays: int, deadline: float) -> dict:
    x = torch.randn(M, shape.K, device="cuda").bfloat16()
    row = dict(shape=shape.name, M=M, N=shape.N, K=shape.K, cublas=measure(shape, x, weights, biases, None, replays),
               configs=[])
    for cfg in candidates(M, shape.K):
        entry = dict(config=asdict(cfg), label=label(cfg))
        if time.monotonic() > deadline:
            entry["error"] = "skipped: --budget-s spent"
        else:
            try:
                entry.update(measure(shape, x, weights, biases, cfg, replays))
            except Exception as e:  # a config that cannot compile or launch is a result, not a crash
                entry["error"] = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"
                if not context_alive():
                    row["configs"].append(entry)
                    raise RuntimeError(f"CUDA context broken by {label(cfg)} at {shape.name} M={M}") from e
        row["configs"].append(entry)
    timed = [c for c in row["configs"] if "us" in c]
    row["best"] = min(timed, key=lambda c: c["us"]) if timed else None
    return row


def print_row(row: dict) -> None:
    cub, best = row["cublas"], row["best"]
    failed = sum("error" in c for c in row["configs"])
    head = f"{row['shape']:8s} M={row['M']:<3d} "
    head += (f"cublas {cub['us']:8.2f} us {cub['tbps']:5.2f} TB/s | " if "us" in cub
             else f"cublas FAILED ({cub['error']}) | ")
    if best is None:
        print(f"{head}no gemv config ran ({failed} of {len(row['configs'])} failed)", flush=True)
        return
    speedup = f"x{cub['us'] / best['us']:4.2f}" if "us" in cub else ""
    print(f"{head}gemv {best['us']:8.2f} us {best['tbps']:5.2f} TB/s {speedup}  [{best['label']}]  "
          f"({len(row['configs'])} configs, {failed} failed)", flush=True)


def step_savings(rows: list[dict]) -> dict:
    """Per M: us saved per decode step using, per shape, the faster of cuBLAS
    and the best gemv config (per-layer shapes x36, lm_head once)."""
    per_step = {s.name: s.per_step for s in SHAPES}
    out = {}
    for row in rows:
        if row["best"] is None or "us" not in row["cublas"]:
            continue
        gain = max(0.0, row["cublas"]["us"] - row["best"]["us"]) * per_step[row["shape"]]
        entry = out.setdefault(str(row["M"]), dict(total_us=0.0, per_shape_us={}))
        entry["per_shape_us"][row["shape"]] = round(gain, 2)
        entry["total_us"] = round(entry["total_us"] + gain, 2)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, default=Path("gemv_bench.json"))
    p.add_argument("--ms", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    p.add_argument("--shapes", nargs="+", default=[s.name for s in SHAPES], choices=[s.name for s in SHAPES])
    p.add_argument("--replays", type=int, default=50, help="graph replays per measurement (lm_head: a fifth)")
    p.add_argument("--budget-s", type=float, default=170.0, help="after this, remaining gemv configs are skipped")
    p.add_argument("--pdl", action="store_true",
                   help="launch the gemv kernels with programmatic dependent launch, as small decode "
                        "batches do (pipeline/kernels/dependent_launch.py); cuBLAS is unchanged")
    args = p.parse_args()
    dependent_launch.allow(args.pdl)
    with dependent_launch.launching(args.pdl):
        return run(args)


def run(args) -> int:
    started = time.monotonic()
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 << 20)
    report = dict(device=props.name, torch=torch.__version__, triton=triton.__version__, l2_bytes=l2,
                  layers=LAYERS, replays=args.replays, pdl=args.pdl, rows=[])
    print(f"{props.name}, torch {torch.__version__}, triton {triton.__version__}, L2 {l2 >> 20} MiB", flush=True)
    status = 0
    try:
        for shape in (s for s in SHAPES if s.name in args.shapes):
            weights, biases = make_operands(shape, l2)
            replays = args.replays if shape.per_step > 1 else max(5, args.replays // 5)
            for M in args.ms:
                row = bench_shape_m(shape, M, weights, biases, replays, started + args.budget_s)
                report["rows"].append(row)
                print_row(row)
            del weights, biases
            torch.cuda.empty_cache()
            args.json.write_text(json.dumps(report, indent=1))
            print(f"-- {shape.name} done at {time.monotonic() - started:.0f} s", flush=True)
    except RuntimeError as e:
        report["fatal"] = str(e)
        print(f"FATAL: {e}", flush=True)
        status = 1
    report["step_savings_us"] = step_savings(report["rows"])
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    args.json.write_text(json.dumps(report, indent=1))
    for M, entry in report["step_savings_us"].items():
        print(f"saving per decode step at M={M}: {entry['total_us']:.1f} us  {entry['per_shape_us']}")
    print(f"wrote {args.json} after {report['elapsed_s']} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
