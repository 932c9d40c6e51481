#!/usr/bin/env python3
"""The unified paged attention kernel against flash SDPA, side by side in one
run on one GPU (the GPU box, not CI), at the Qwen2.5-VL-3B shape: 16 q heads,
2 kv heads, head dim 128, bf16, pages of 16 slots, blocks shuffled.

For each prefill shape (a 2048-token chunk from position 0, 1024 after a
1024 context, 2048 after 2048) one layer's launch, captured in a CUDA graph
and replayed (median of --replays), of:
- the kernel of pipeline/kernels/unified_attention.py ("new"), with 32
  decode rows of context 512 beside the chunk and the token bucket's padding
  as in a captured mixed step, and again on the chunk alone;
- flash SDPA on the chunk alone: contiguous [1, 16, T, 128] with the kv
  heads repeated, causal (bottom-right aligned after a context); and the
  eager mixed path's own call (causal_attention: a boolean mask after a
  context, which keeps SDPA off flash);
- the new kernel at other tilings (tokens per program, block_n, num_warps,
  num_stages) on the mixed launch, while --sweep-budget-s lasts.
(The kernel it replaced, git d620e29, was timed beside it once and then
dropped from this script: docs/benchmarks.md, fourth session.)
Every output is checked against unified_attention_reference in float32.
TFLOP/s count the causal (query, key) pairs of every head, 4 * head_dim
flops each; step_gap_36_layers_ms is (kernel - flash) x the model's 36
layers, the prefill part of a captured mixed step's excess over eager.

    timeout 300 python3 scripts/gpu_unified_bench.py --json unified_bench.json

(meant to take well under 2 minutes on one H200: a dozen Triton compiles,
the float32 references, and sub-millisecond replays).

A case that fails is recorded with its traceback and the run goes on; the
JSON is rewritten after each case.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402
from torch.nn.attention.bias import causal_lower_right  # noqa: E402

from pipeline.engine.mixed_graphs import token_bucket  # noqa: E402
from pipeline.kernels import unified_attention as ua  # noqa: E402
from pipeline.models.attention import causal_attention  # noqa: E402

HEADS, KV_HEADS, DIM, PAGE = 16, 2, 128, 16
CASES = {"chunk2048_ctx0": (2048, 0), "chunk1024_ctx1024": (1024, 1024), "chunk2048_ctx2048": (2048, 2048)}
DECODES, DECODE_CONTEXT, MAX_SEQS = 32, 512, 64   # MAX_SEQS: the engine's default, for the grid's spare programs
# (tokens per program, block_n, num_warps, num_stages) beside the defaults
# (16, 64, 8, 3); 8 tokens are the 3B model's 64 rows per program.
SWEEP = [(16, 64, 8, 2), (16, 64, 8, 4), (16, 32, 8, 3), (16, 128, 8, 2), (8, 64, 4, 3), (8, 64, 4, 2),
         (8, 32, 4, 3), (8, 64, 8, 3)]
TOLERANCE = dict(atol=2e-2, rtol=2e-2)


def make_case(chunk: int, context: int, decodes: int, device: torch.device, seed: int) -> dict:
    """Decodes first, then the chunk, then the bucket's padding sequence; each
    sequence's blocks drawn at random from one cache, the null block last."""
    gen = torch.Generator().manual_seed(seed)
    specs = [(1, DECODE_CONTEXT)] * decodes + [(chunk, context)]
    blocks = [-(-(q + c) // PAGE) for q, c in specs]
    null = sum(blocks)
    order = torch.randperm(null, generator=gen)
    width = max(blocks)
    tables = torch.full((len(specs), width), null)
    for row, used, first in zip(tables, blocks, np.cumsum([0] + blocks)):
        row[:used] = order[first:first + used]
    tokens = sum(q for q, _ in specs)
    bucket = token_bucket(tokens, 16)
    query = np.array([q for q, _ in specs] + [bucket - tokens])
    cu, ctx = [0] + np.cumsum(query).tolist(), [c for _, c in specs] + [-1]
    k_slots, v_slots = (torch.randn((null + 1) * PAGE, KV_HEADS, DIM, generator=gen).to(device, torch.bfloat16)
                        for _ in range(2))
    q = torch.randn(bucket, HEADS, DIM, generator=gen).to(device, torch.bfloat16)
    as_device = lambda x: torch.tensor(x, device=device)  # noqa: E731
    pairs = sum(q_len * c + q_len * (q_len + 1) // 2 for q_len, c in specs)
    return dict(specs=specs, query=query, cu=cu, ctx=ctx, width=width, q=q, k=k_slots, v=v_slots,
                tables=tables.view(-1).to(device), args=(as_device([width]), as_device(cu), as_device(ctx)),
                tokens=tokens, bucket=bucket, flops=4 * HEADS * DIM * pairs)


def plan(case: dict, per_program: int) -> torch.Tensor:
    programs = np.zeros((ua.max_programs(case["bucket"], MAX_SEQS, per_program), 2), dtype=np.int64)
    ua.plan_programs(case["query"], per_program, programs)
    return torch.from_numpy(programs).to(case["q"].device)


def graph_ms(fn, replays: int) -> tuple[float, torch.Tensor]:
    """Median ms of one replay of fn() captured alone, and its output."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()   # Triton compiles, lazy inits
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    for _ in range(3):
        graph.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return float(np.median([start.elapsed_time(end) for start, end in events])), out


def check(got: torch.Tensor, want: torch.Tensor) -> dict:
    got = got.float()
    return {"max_abs_diff": (got - want).abs().max().item(), "ok": bool(torch.allclose(got, want, **TOLERANCE))}


def reference(case: dict) -> torch.Tensor:
    """float32 truth for the case's rows (padding rows zero), computed once."""
    if "truth" not in case:
        q, k, v = (case[name].float() for name in ("q", "k", "v"))
        case["truth"] = ua.unified_attention_reference(q, k, v, case["tables"], case["width"], case["cu"],
                                                       case["ctx"], PAGE)
    return case["truth"]


def unified_runs(case: dict, replays: int, configs: list[tuple[int, int, int, int] | None]) -> dict:
    """The kernel at each config (None: its defaults) on one case; each
    {"ms", "tflops", "max_abs_diff", "ok"}."""
    truth = reference(case)
    inputs = (case["q"], case["k"], case["v"], case["tables"], *case["args"])
    runs = {}
    for config in configs:
        per_program, block_n, warps, stages = config or (ua.block_q(HEADS, KV_HEADS), None, None, None)
        name = "new" if config is None else f"new_q{per_program}_bn{block_n}_w{warps}_s{stages}"
        runs[name] = lambda p=per_program, b=block_n, w=warps, s=stages, programs=plan(case, per_program): (
            ua.unified_attention(*inputs, programs, PAGE, per_program=p, block_n=b, num_warps=w, num_stages=s))
    out = {}
    for name, fn in runs.items():
        try:
            ms, got = graph_ms(fn, replays)
            out[name] = dict(ms=ms, tflops=case["flops"] / ms / 1e9, **check(got, truth))
        except Exception:   # one config out of resources must not end the run
            out[name] = {"error": traceback.format_exc()}
    return out


def sdpa_runs(case: dict, replays: int) -> dict:
    """Flash SDPA and the eager path's causal_attention on the case's chunk
    (the last real sequence), keys gathered contiguous, kv heads repeated."""
    lo, hi = case["cu"][-3], case["cu"][-2]
    context = case["ctx"][-2]
    pos = torch.arange(context + hi - lo, device=case["q"].device)
    slots = case["tables"][(len(case["specs"]) - 1) * case["width"] + pos // PAGE] * PAGE + pos % PAGE
    group = HEADS // KV_HEADS
    q = case["q"][lo:hi].transpose(0, 1)[None].contiguous()
    k, v = (case[name].index_select(0, slots).transpose(0, 1).repeat_interleave(group, 0)[None].contiguous()
            for name in ("k", "v"))
    truth = reference(case)[lo:hi].transpose(0, 1)[None]

    def flash():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            if context == 0:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(hi - lo, context + hi - lo))

    out = {}
    for name, fn in (("flash", flash), ("eager_sdpa", lambda: causal_attention(q, k, v, context))):
        try:
            ms, got = graph_ms(fn, replays)
            out[name] = dict(ms=ms, tflops=case["flops"] / ms / 1e9, **check(got, truth))
        except Exception:
            out[name] = {"error": traceback.format_exc()}
    return out


def run_case(chunk: int, context: int, replays: int, sweep: bool, device: torch.device) -> dict:
    mixed = make_case(chunk, context, DECODES, device, seed=1)
    alone = make_case(chunk, context, 0, device, seed=1)
    result = {"mixed": dict(tokens=mixed["tokens"], bucket=mixed["bucket"], tflop=mixed["flops"] / 1e12,
                            **unified_runs(mixed, replays, [None] + (SWEEP if sweep else []))),
              "prefill_only": dict(tokens=alone["tokens"], bucket=alone["bucket"], tflop=alone["flops"] / 1e12,
                                   **unified_runs(alone, replays, [None]), **sdpa_runs(alone, replays))}
    ms = lambda part, name: result[part].get(name, {}).get("ms")  # noqa: E731
    ratios = {"new_over_flash": (ms("prefill_only", "new"), ms("prefill_only", "flash")),
              "new_over_eager_sdpa": (ms("prefill_only", "new"), ms("prefill_only", "eager_sdpa"))}
    result["ratios"] = {name: a / b if a and b else None for name, (a, b) in ratios.items()}
    flash = ms("prefill_only", "flash")
    new = ms("prefill_only", "new")
    result["step_gap_36_layers_ms"] = 36 * (new - flash) if new and flash else None
    return result


def summary(name: str, result: dict) -> str:
    def part(p: str, run: str) -> str:
        r = result[p].get(run, {})
        return "error" if "ms" not in r else f"{r['ms']:.3f} ms {r['tflops']:.0f} TF/s{'' if r['ok'] else ' NOT OK'}"

    ratios = " ".join(f"{k}={v:.2f}" for k, v in result["ratios"].items() if v)
    gap = result["step_gap_36_layers_ms"]
    ratios += f" gap36={gap:.1f}ms" if gap is not None else ""
    return (f"{name}: mixed(+{DECODES} decodes, bucket {result['mixed']['bucket']}) new {part('mixed', 'new')}"
            f"\n  prefill only: new {part('prefill_only', 'new')} | flash {part('prefill_only', 'flash')}"
            f" | eager sdpa {part('prefill_only', 'eager_sdpa')}\n  {ratios}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--sweep-budget-s", type=float, default=70.0,
                        help="time the other configs only while the run is younger than this")
    args = parser.parse_args()
    device = torch.device("cuda")
    began = time.perf_counter()
    results = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "triton": triton.__version__,
               "shape": dict(heads=HEADS, kv_heads=KV_HEADS, head_dim=DIM, page=PAGE, dtype="bfloat16"),
               "new_block_q": ua.block_q(HEADS, KV_HEADS), "cases": {}}
    for name, (chunk, context) in CASES.items():
        try:
            sweep = time.perf_counter() - began < args.sweep_budget_s
            results["cases"][name] = run_case(chunk, context, args.replays, sweep, device)
            print(summary(name, results["cases"][name]), flush=True)
        except Exception:
            results["cases"][name] = {"error": traceback.format_exc()}
            print(f"{name}: FAILED\n{results['cases'][name]['error']}", flush=True)
        torch.cuda.empty_cache()
        if args.json:
            args.json.write_text(json.dumps(results, indent=2))
    results["wall_s"] = time.perf_counter() - began
    for name, case in results["cases"].items():
        for config, run in case.get("mixed", {}).items():
            if config.startswith("new_q") and "ms" in run:
                print(f"  sweep {name} {config}: {run['ms']:.3f} ms{'' if run['ok'] else ' NOT OK'}")
    print(f"wall {results['wall_s']:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
