"""Decode speed for scripts/gpu_engine_check.py: whole engine steps of a
Qwen2.5-VL-3B-shaped language model with random weights at batch 1 and 32,
beside the weight-read floor (weight bytes / measured device copy
bandwidth); on the fast path also the graph replay alone, the top CUDA
kernels of one replay, and mixed-step timings (scripts/gpu_mixed_check.py);
and the cuBLAS / gemv comparison of two such runs."""

from __future__ import annotations

import time

import numpy as np
import torch

from gpu_mixed_check import mixed_step_timings
from pipeline.engine.engine import Engine, EngineConfig
from pipeline.sampling_params import SamplingParams
from pipeline.models.shapes import random_model
from pipeline.models.tiny import default_model_dir
from pipeline.processing.processor import MultimodalPrompt
from pipeline.processing.tokenizer import Tokenizer


def copy_bandwidth(device: torch.device) -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        b.copy_(a)
    end.record()
    torch.cuda.synchronize()
    return 2 * 10 * a.numel() / (start.elapsed_time(end) / 1000)  # read + write bytes per second


def _device_us(event) -> float:
    # The attribute's name moved between torch releases (cuda_* -> device_*).
    for name in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(event, name):
            return float(getattr(event, name))
    return 0.0


def kernel_breakdown(replay, eager, top: int = 15) -> dict:
    """The top CUDA kernels of one graph replay by total device time. Where
    the profiler does not see inside graphs, one eager forward of the same
    bucket is profiled instead (same kernels, plus launch gaps)."""
    from torch.profiler import ProfilerActivity, profile

    for source, run in (("graph_replay", replay), ("eager_forward", eager)):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        rows = [(e.key, e.count, _device_us(e)) for e in prof.key_averages() if _device_us(e) > 0]
        if rows:
            break
    rows.sort(key=lambda r: -r[2])
    total = sum(r[2] for r in rows)
    return {"source": source, "kernel_launches": sum(r[1] for r in rows), "kernel_total_us": total,
            "top": [{"kernel": name[:120], "calls": calls, "total_us": us, "share": us / total if total else 0.0}
                    for name, calls, us in rows[:top]]}


def decode_speed(device: torch.device, batches: list[int], fast_decode: bool, out: dict, context: int = 512,
                 steps: int = 20, profile: bool = True, matmul: str = "cublas") -> dict:
    """Fills `out` as it goes (kept if a later batch fails) and returns it.
    With matmul "triton" the mixed step is not timed: it runs cuBLAS either way."""
    loaded = random_model("qwen2.5-vl-3b", torch.bfloat16, device)
    model = loaded.model
    lm_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not n.startswith("visual."))
    bandwidth = copy_bandwidth(device)
    # Weights are read once per step. The copy moves `bandwidth` bytes per
    # second counting reads and writes; a pure read can use all of it.
    floor_ms = lm_bytes / bandwidth * 1000
    out.update({"lm_weight_gb": lm_bytes / 1e9, "copy_bandwidth_tb_s": bandwidth / 1e12, "floor_ms": floor_ms})
    tokenizer = Tokenizer.from_checkpoint(default_model_dir())  # only for the engine's text state
    for batch in batches:
        engine = Engine(model, tokenizer, EngineConfig(max_num_batched_tokens=max(8192, batch * context),
                                                       max_num_seqs=batch + 1, kv_cache_bytes=8 << 30,
                                                       # Mixed steps are timed only with cuBLAS:
                                                       # no mixed graphs to capture for gemv.
                                                       fast_decode=fast_decode,
                                                       fast_mixed=None if matmul == "cublas" else False,
                                                       decode_matmul=matmul), device)
        for i in range(batch):
            ids = list(np.random.default_rng(i).integers(0, 150000, context))
            engine.add_request(f"b{i}", MultimodalPrompt([int(x) for x in ids], [], []), [],
                               SamplingParams(max_tokens=steps + 10, ignore_eos=True))
        t_warm = time.perf_counter()
        engine.step()  # prefill
        engine.step()
        engine.step()  # a second decode: graphs captured by now
        torch.cuda.synchronize()
        out[f"batch{batch}_warmup_s"] = time.perf_counter() - t_warm
        step_ms = _median_ms(engine.step, steps)
        out[f"batch{batch}_step_ms"] = step_ms
        out[f"batch{batch}_vs_floor"] = step_ms / floor_ms
        decode = engine.runner.decode
        if decode is not None and decode.last_bucket in decode.graphs:
            # The captured forward of the timed steps' bucket alone: what is
            # left is host work per step.
            key = decode.last_bucket
            graph, _ = decode.graphs[key]
            out[f"batch{batch}_graph_replay_ms"] = _median_ms(graph.replay, steps)
            out[f"batch{batch}_fused_kernels"] = decode.fused
            if profile:
                def eager():
                    with torch.inference_mode():
                        decode._forward(*key)
                out[f"batch{batch}_profile"] = kernel_breakdown(graph.replay, eager)
        if matmul == "cublas":
            out.update(mixed_step_timings(engine, context * 4, steps, batch))
        del engine
        torch.cuda.empty_cache()
    return out


def matmul_comparison(cublas: dict, triton: dict, batches: list[int]) -> dict:
    """fast_decode (cuBLAS projections) against fast_decode_gemv per batch:
    both times and triton / cublas (below 1: gemv is faster). Batches over
    8 rows run cuBLAS in both, so their ratio is run-to-run noise."""
    out = {}
    for batch in batches:
        for what in ("step_ms", "graph_replay_ms"):
            key = f"batch{batch}_{what}"
            if key in cublas and key in triton:
                out[key] = {"cublas": cublas[key], "triton": triton[key],
                            "triton_over_cublas": triton[key] / cublas[key]}
    return out


def _median_ms(work, repeats: int) -> float:
    """Median wall milliseconds of work() with the GPU drained before and after each call."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        work()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1000)
    return float(np.median(times))
