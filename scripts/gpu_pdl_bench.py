#!/usr/bin/env python3
"""Programmatic dependent launch on the decode step (issue 14 part 6; GPU
box only, not in CI).

A Qwen2.5-VL-3B-shaped language model with random bf16 weights, the fast
decode path with gemv projections (main's default on CUDA), run with the
fused kernels launched two ways, side by side in one process and
interleaved over rounds (machines drift):
  off       plain launches (main before PDL);
  pdl       the fused kernels of decode buckets up to --pdl-max-batch rows
            launched with PDL, each waiting at its top.
Each --apart name adds a way that runs pdl with one fusion undone, main
before it (its tokens must equal off's too: each fusion rounds as the
kernels it replaced):
  silu    the MLP's SiLU * up as its own kernel after gate_up (before
          gemv_silu_mul fused it into gate_up's epilogue);
  rotary  rotary + K/V write as its own kernel after the q/k/v gemv
          (before gemv_rotary_kv fused them);
  preload one-row gemvs reading their weight after the grid wait, in the
          pipelined loop (before GemvConfig.preload). That sums K in
          another order, so its tokens are checked against its own other
          rounds (a race would show as a difference), not against off's.
(A third, decode attention's split-K partials merged by the split program
that finished last instead of a kernel of their own, measured 13.7% slower
at batch 1 and was dropped: commit 2e83a7c has it.)
(Another way, each gemv program prefetching its first weight lines into L2
before its wait, measured no better than pdl and was dropped: commit
24244a8 has it. Another, a PDL kernel after each gemv prefetching the next
short projection's whole weight into L2, measured slower: commit 77e6395.)
For each way and batch: the median engine step with the GPU drained before
and after each, the mean step of as many run back to back (as a server runs
them: decode ahead overlaps a step's host work with the last one's kernels),
the device time of the captured graph's replay (CUDA events over back-to-back replays), and every
token the steps produced, which must equal the `off` run's (same
arithmetic; a missed wait would show as a race).

    timeout 500 python3 scripts/gpu_pdl_bench.py --json $OUT/pdl.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from pipeline.engine import decode_graphs  # noqa: E402
from pipeline.engine.engine import Engine, EngineConfig  # noqa: E402
from pipeline.kernels import dependent_launch  # noqa: E402
from pipeline.kernels import gemv as gemv_module  # noqa: E402
from pipeline.kernels.ops import TritonLayerOps  # noqa: E402
from pipeline.kernels.paged_backend import TritonDecodeAttention  # noqa: E402
from pipeline.models.attention import AttentionBackend  # noqa: E402
from pipeline.models.layers import LayerOps  # noqa: E402
from pipeline.models.shapes import random_model  # noqa: E402
from pipeline.models.tiny import default_model_dir  # noqa: E402
from pipeline.processing.processor import MultimodalPrompt  # noqa: E402
from pipeline.processing.tokenizer import Tokenizer  # noqa: E402
from pipeline.sampling_params import SamplingParams  # noqa: E402
from gpu_decode_speed import _median_ms, copy_bandwidth  # noqa: E402

WAYS = {"off": False, "pdl": True}
# --apart name: (owner, attribute, what it is set to while that way runs).
APART = {
    "silu": (TritonLayerOps, "gated_linear", LayerOps.gated_linear),
    "rotary": (TritonDecodeAttention, "attend_projected", AttentionBackend.attend_projected),
    "preload": (gemv_module, "PRELOAD_MAX", 0),
}
OWN_ARITHMETIC = {"pdl-preload-apart"}   # ways whose tokens need not equal off's


@contextmanager
def undone(way: str):
    """Way "pdl-<name>-apart": that fusion undone while the engine is built,
    captured and run; any other way runs as main."""
    name = way.removeprefix("pdl-").removesuffix("-apart")
    if not way.endswith("-apart") or name not in APART:
        yield
        return
    owner, attribute, stand_in = APART[name]
    fused = getattr(owner, attribute)
    setattr(owner, attribute, stand_in)
    try:
        yield
    finally:
        setattr(owner, attribute, fused)


def replay_device_ms(graph, replays: int = 100) -> float:
    """Device milliseconds per replay over back-to-back replays (no host
    gap between them: the graph's own kernels and gaps only)."""
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def replay_timeline(graph, top: int = 12) -> dict:
    """One profiled replay: per kernel name, launches, summed duration, and
    exposed time (what it adds to the timeline beyond the kernels that
    started before it: with PDL a kernel's duration includes its wait), and
    the idle time between kernels. Kernels inside graphs need CUPTI's graph
    records; `kernels` is 0 where the profiler saw none."""
    from torch.profiler import ProfilerActivity, profile
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    by_name: dict[str, dict] = {}
    frontier, idle = None, 0.0
    for start, end, name in spans:
        if frontier is not None:
            idle += max(0.0, start - frontier)
        exposed = end - start if frontier is None else max(0.0, end - max(start, frontier))
        frontier = end if frontier is None else max(frontier, end)
        row = by_name.setdefault(name[:80], {"launches": 0, "duration_us": 0.0, "exposed_us": 0.0})
        row["launches"] += 1
        row["duration_us"] += end - start
        row["exposed_us"] += exposed
    rows = sorted(by_name.items(), key=lambda kv: -kv[1]["exposed_us"])
    span = spans[-1][1] - spans[0][0] if spans else 0.0
    return {"kernels": len(spans), "span_us": span, "idle_us": idle,
            "top": [{"kernel": k, **{f: round(v, 1) if isinstance(v, float) else v for f, v in row.items()}}
                    for k, row in rows[:top]]}


def run_way(model, tokenizer, device, pdl: bool, batch: int, context: int, steps: int,
            timeline: bool = False) -> dict:
    engine = Engine(model, tokenizer, EngineConfig(max_num_batched_tokens=max(8192, batch * context),
                                                   max_num_seqs=batch + 1, kv_cache_bytes=8 << 30,
                                                   fast_decode=True, fast_mixed=False, decode_matmul="triton",
                                                   capture_decode_len=2 * context, dependent_launch=pdl),
                    device)
    for i in range(batch):
        ids = [int(x) for x in np.random.default_rng(i).integers(0, 150000, context)]
        engine.add_request(f"b{i}", MultimodalPrompt(ids, [], []), [],
                           SamplingParams(max_tokens=2 * steps + 10, ignore_eos=True))
    tokens: dict[str, list[int]] = {}

    def step():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    for _ in range(3):  # prefill, then decodes until the graphs are captured
        step()
    step_ms = _median_ms(step, steps)
    # As a server runs them: back to back, no wait between (decode ahead
    # then overlaps each step's host work with the last one's kernels).
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    steady_ms = (time.perf_counter() - t) * 1000 / steps
    decode = engine.runner.decode
    graph, _ = decode.graphs[decode.last_bucket]
    result = {"step_ms": step_ms, "steady_step_ms": steady_ms, "replay_ms": replay_device_ms(graph),
              "tokens": [tokens[f"b{i}"] for i in range(batch)]}
    if timeline:
        result["timeline"] = replay_timeline(graph)
    return result  # the engine (and its KV cache) goes with this frame


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--json", type=Path)
    p.add_argument("--batches", default="1,32")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--timeline", action="store_true",
                   help="also profile one replay per way and batch in the first round (kernel times, exposed)")
    p.add_argument("--apart", default="",
                   help=f"comma-separated fusions, of {sorted(APART)}: each adds the way pdl-<name>-apart, "
                        "pdl with that fusion undone")
    p.add_argument("--pdl-max-batch", type=int, default=None,
                   help="decode buckets up to this many rows use PDL in the pdl way "
                        "(default: the engine's, decode_graphs.DEPENDENT_LAUNCH_MAX_BATCH)")
    args = p.parse_args()
    if args.pdl_max_batch is not None:
        decode_graphs.DEPENDENT_LAUNCH_MAX_BATCH = args.pdl_max_batch
    device = torch.device("cuda:0")
    import triton
    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
              "pdl_supported": dependent_launch.supported(device),
              "pdl_max_batch": decode_graphs.DEPENDENT_LAUNCH_MAX_BATCH}
    print(json.dumps(report), flush=True)
    if not report["pdl_supported"]:
        print("PDL not supported here", flush=True)
        return 1
    model = random_model("qwen2.5-vl-3b", torch.bfloat16, device).model
    lm_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not n.startswith("visual."))
    report["floor_ms"] = lm_bytes / copy_bandwidth(device) * 1000
    tokenizer = Tokenizer.from_checkpoint(default_model_dir())
    runs: dict = {}
    names = [name for name in args.apart.split(",") if name]
    if set(names) - set(APART):
        p.error(f"--apart: unknown {sorted(set(names) - set(APART))}; known {sorted(APART)}")
    apart = [f"pdl-{name}-apart" for name in names]
    chosen = {**WAYS, **{way: True for way in apart}}
    for r in range(args.rounds):
        for batch in [int(b) for b in args.batches.split(",")]:
            for way, on in chosen.items():
                with undone(way):
                    got = run_way(model, tokenizer, device, on, batch, args.context, args.steps,
                                  timeline=args.timeline and r == 0)
                if "timeline" in got:
                    report.setdefault("timeline", {}).setdefault(f"batch{batch}", {})[way] = got.pop("timeline")
                torch.cuda.empty_cache()
                runs.setdefault(f"batch{batch}", {}).setdefault(way, []).append(got)
                print(f"round {r} batch {batch} {way}: step {got['step_ms']:.3f} ms, back to back "
                      f"{got['steady_step_ms']:.3f} ms, replay {got['replay_ms']:.3f} ms", flush=True)
    summary, failed = {}, []
    for key, ways in runs.items():
        want = ways["off"][0]["tokens"]
        row = {}
        for way, results in ways.items():
            same = all(res["tokens"] == want for res in results)
            if way in OWN_ARITHMETIC:
                if not all(res["tokens"] == results[0]["tokens"] for res in results):
                    failed.append(f"{key}.{way}: tokens differ between its rounds")
            elif not same:
                failed.append(f"{key}.{way}: tokens differ from off")
            row[way] = {what: float(np.median([res[what] for res in results]))
                        for what in ("step_ms", "steady_step_ms", "replay_ms")}
            row[way]["tokens_equal_off"] = same
        for what in ("step_ms", "steady_step_ms", "replay_ms"):
            row["pdl"][f"{what}_over_off"] = row["pdl"][what] / row["off"][what]
            for way in apart:
                row["pdl"][f"{what}_over_{way.removeprefix('pdl-').replace('-', '_')}"] = \
                    row["pdl"][what] / row[way][what]
        for way in ways:
            row[way]["step_vs_floor"] = row[way]["step_ms"] / report["floor_ms"]
            row[way]["steady_step_vs_floor"] = row[way]["steady_step_ms"] / report["floor_ms"]
        summary[key] = row
    report.update({"summary": summary, "failed": failed,
                   "runs": {k: {w: [{key: x[key] for key in ("step_ms", "steady_step_ms", "replay_ms")} for x in v]
                                for w, v in ways.items()} for k, ways in runs.items()}})
    print(json.dumps(report["summary"], indent=1), flush=True)
    print("failed:", failed, flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
