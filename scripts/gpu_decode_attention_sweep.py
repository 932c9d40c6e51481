#!/usr/bin/env python3
"""Split count and tile of the paged decode attention at small batches
(issue 14 part 6; GPU box only, not in CI).

The batch-1 replay's timeline (scripts/gpu_pdl_bench.py --timeline) puts
the split kernel and its merge at 194 us of exposed time a step, 5.4 us a
layer for 512 tokens of context: latency, not bytes (0.5 MB a layer). This
times, for 3B heads (16 q heads, 2 kv heads, head_dim 128, bf16, 16-token
pages) at batch 1, 2 and 8 and several context lengths, every (num_splits,
block_n) against plan_splits' choice: a CUDA graph of 36 launches back to
back, as the 36 layers run them, with PDL on (as small decode batches
launch), replayed; each result checked against plan_splits' output.

    timeout 200 python3 scripts/gpu_decode_attention_sweep.py --json $OUT/attn.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import triton  # noqa: E402

from pipeline.kernels import dependent_launch  # noqa: E402
from pipeline.kernels.decode_attention import paged_decode_attention, plan_splits  # noqa: E402
from gpu_pdl_bench import replay_device_ms  # noqa: E402

LAYERS, HEADS, KV_HEADS, DIM, PAGE = 36, 16, 2, 128, 16


def operands(batch: int, context: int, device):
    gen = torch.Generator(device=device).manual_seed(0)
    pages = triton.cdiv(context, PAGE)
    slots = batch * pages * PAGE
    k = torch.randn(slots, KV_HEADS, DIM, device=device, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(slots, KV_HEADS, DIM, device=device, dtype=torch.bfloat16, generator=gen)
    q = torch.randn(batch, HEADS, DIM, device=device, dtype=torch.bfloat16, generator=gen)
    tables = torch.arange(batch * pages, device=device, dtype=torch.int32).view(batch, pages)
    lengths = torch.full((batch,), context, device=device, dtype=torch.int32)
    return q, k, v, tables, lengths


def time_us(launch, replays: int = 30) -> float:
    launch()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(LAYERS):
            launch()
    return replay_device_ms(graph, replays) * 1e3 / LAYERS


def sweep(batch: int, context: int, sms: int, device) -> dict:
    q, k, v, tables, lengths = operands(batch, context, device)
    planned = plan_splits(batch, KV_HEADS, context, sms)
    want = paged_decode_attention(q, k, v, tables, lengths, PAGE, *planned)
    rows = []
    for block_n in (32, 64, 128):
        tiles = triton.cdiv(context, block_n)
        for splits in sorted({s for s in (1, 2, 4, 8, 16, 32, 64) if s <= tiles}):
            split_len = triton.cdiv(tiles, splits) * block_n
            num_splits = triton.cdiv(context, split_len)

            def launch(num_splits=num_splits, split_len=split_len, block_n=block_n):
                return paged_decode_attention(q, k, v, tables, lengths, PAGE, num_splits, split_len, block_n)
            diff = (launch().float() - want.float()).abs().max().item()
            rows.append({"block_n": block_n, "num_splits": num_splits, "split_len": split_len,
                         "us": time_us(launch), "max_abs_diff_vs_planned": diff})
    planned_us = next((r["us"] for r in rows if (r["num_splits"], r["split_len"], r["block_n"]) ==
                       (planned[0], planned[1], 32)), None)
    best = min(rows, key=lambda r: r["us"])
    return {"batch": batch, "context": context, "planned": {"num_splits": planned[0], "split_len": planned[1],
                                                            "us": planned_us},
            "best": best, "rows": rows}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--json", type=Path)
    p.add_argument("--batches", default="1,2,8")
    p.add_argument("--contexts", default="512,1024,4096")
    args = p.parse_args()
    device = torch.device("cuda:0")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    dependent_launch.allow(True)
    results = []
    with dependent_launch.launching(True):
        for batch in (int(b) for b in args.batches.split(",")):
            for context in (int(c) for c in args.contexts.split(",")):
                got = sweep(batch, context, sms, device)
                results.append(got)
                b = got["best"]
                print(f"batch {batch} context {context}: planned {got['planned']}; best {b['num_splits']} splits "
                      f"of {b['split_len']} (block_n {b['block_n']}) {b['us']:.2f} us", flush=True)
    bad = [r for g in results for r in g["rows"] if r["max_abs_diff_vs_planned"] > 2e-2]
    report = {"device": torch.cuda.get_device_name(0), "pdl": True, "results": results, "failed": len(bad)}
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    print("failed:", len(bad))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
