#!/usr/bin/env python3
"""The engine on a GPU (run on the GPU box, not in CI):

1. correctness: the tiny checkpoint in float32 on CUDA, several requests with
   images batched through the engine, equal to offline greedy generation of
   each alone on the same device;
2. speed: decode step time at batch 1 and 32 for a Qwen2.5-VL-3B-shaped
   language model with random weights (made on the GPU), with the reference
   attention backend, beside the weight-read floor (weight bytes / measured
   device copy bandwidth), all in this one run.

    python scripts/gpu_engine_check.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

from pipeline.engine.engine import Engine, EngineConfig  # noqa: E402
from pipeline.engine.request import SamplingParams  # noqa: E402
from pipeline.generate import GenerationLimits, greedy_generate  # noqa: E402
from pipeline.models.loader import load_model  # noqa: E402
from pipeline.models.shapes import random_model  # noqa: E402
from pipeline.models.tiny import default_model_dir  # noqa: E402
from pipeline.processing.image import preprocess_images  # noqa: E402
from pipeline.processing.processor import Processor  # noqa: E402
from pipeline.processing.tokenizer import Tokenizer  # noqa: E402


def attention_equality(device: torch.device) -> dict:
    """The fast decode attention against the reference backend, bf16, 3B-like heads."""
    from pipeline.engine.decode_graphs import GatherDecodeAttention
    from pipeline.engine.paged_attention import PagedKVCache, ReferencePagedAttention, SequenceSlice, StepLayout

    gen = torch.Generator(device=device).manual_seed(0)
    cache = PagedKVCache(1, 600, 16, 2, 128, torch.bfloat16, device)
    cache.keys.normal_(generator=gen)
    cache.values.normal_(generator=gen)
    lens = [5, 300, 1023, 77]
    tables = [list(range(1 + 70 * i, 1 + 70 * i + (n + 16) // 16)) for i, n in enumerate(lens)]
    q = torch.randn(len(lens), 16, 128, device=device, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(len(lens), 2, 128, device=device, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(len(lens), 2, 128, device=device, dtype=torch.bfloat16, generator=gen)
    layout = StepLayout.build([SequenceSlice(i, 1, n, tuple(t)) for i, (n, t) in enumerate(zip(lens, tables))],
                              16, device)
    ref = ReferencePagedAttention(cache, layout).attend(0, q, k, v)
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device)
    slots = torch.tensor([t[n // 16] * 16 + n % 16 for t, n in zip(tables, lens)], device=device)
    fast = GatherDecodeAttention(cache, slots, bt, torch.tensor(lens, device=device) + 1, 1024).attend(0, q, k, v)
    diff = (fast.float() - ref.float()).abs().max().item()
    return {"max_abs_diff": diff, "ref_max_abs": ref.float().abs().max().item(), "ok": diff <= 2e-2}


def correctness(device: torch.device, fast_decode: bool) -> dict:
    model_dir = default_model_dir()
    loaded = load_model(model_dir, dtype="float32", device=str(device))
    processor = Processor.from_checkpoint(model_dir, loaded.config.image_token_id)
    rng = np.random.default_rng(0)
    requests = {}
    for i in range(6):
        images = [Image.fromarray(rng.integers(0, 256, (64 + 32 * j, 96, 3), dtype=np.uint8)) for j in range(i % 3)]
        msgs = [{"role": "user", "content": [{"type": "image"}] * len(images) + [{"type": "text", "text": f"case {i} " * (i + 1)}]}]
        prompt = processor.chat_prompt(msgs, [(im.height, im.width) for im in images])
        pixels = [preprocess_images([im], processor.image_config) for im in images]
        requests[f"r{i}"] = (prompt, [(p, tuple(g[0].tolist())) for p, g in pixels])
    expected = {}
    for rid, (prompt, inputs) in requests.items():
        pix = torch.cat([p for p, _ in inputs]) if inputs else None
        expected[rid] = greedy_generate(loaded.model, prompt, pix, GenerationLimits(16, frozenset(), True))
    engine = Engine(loaded.model, processor.tokenizer,
                    EngineConfig(max_num_batched_tokens=128, fast_decode=fast_decode), device)
    got = {rid: [] for rid in requests}
    for rid, (prompt, inputs) in requests.items():
        keys = [f"{rid}-{j}" for j in range(len(inputs))]
        engine.add_request(rid, prompt, keys, SamplingParams(max_tokens=16, ignore_eos=True))
        for key, (p, g) in zip(keys, inputs):
            engine.add_embedding(key, loaded.model.encode_images(p.to(device), [g])[0])
    while engine.has_work():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    mismatches = [rid for rid in requests if got[rid] != expected[rid]]
    return {"requests": len(requests), "mismatches": mismatches}


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


def decode_speed(device: torch.device, batches: list[int], fast_decode: bool, context: int = 512,
                 steps: int = 20) -> dict:
    loaded = random_model("qwen2.5-vl-3b", torch.bfloat16, device)
    model = loaded.model
    lm_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if not n.startswith("visual."))
    bandwidth = copy_bandwidth(device)
    # Weights are read once per step. The copy moves `bandwidth` bytes per
    # second counting reads and writes; a pure read can use all of it.
    floor_ms = lm_bytes / bandwidth * 1000
    out = {"lm_weight_gb": lm_bytes / 1e9, "copy_bandwidth_tb_s": bandwidth / 1e12, "floor_ms": floor_ms}
    tokenizer = Tokenizer.from_checkpoint(default_model_dir())  # only for the engine's text state
    for batch in batches:
        engine = Engine(model, tokenizer, EngineConfig(max_num_batched_tokens=max(8192, batch * context),
                                                       max_num_seqs=batch, kv_cache_bytes=8 << 30,
                                                       fast_decode=fast_decode), device)
        from pipeline.processing.processor import MultimodalPrompt
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
        torch.cuda.synchronize()
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            engine.step()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t) * 1000)
        out[f"batch{batch}_step_ms"] = float(np.median(times))
        out[f"batch{batch}_vs_floor"] = float(np.median(times)) / floor_ms
        decode = engine.runner.decode
        if decode is not None and decode.graphs:
            # The captured forward alone: what is left is host work per step.
            graph, _ = decode.graphs[max(decode.graphs)]
            replays = []
            for _ in range(steps):
                t = time.perf_counter()
                graph.replay()
                torch.cuda.synchronize()
                replays.append((time.perf_counter() - t) * 1000)
            out[f"batch{batch}_graph_replay_ms"] = float(np.median(replays))
        del engine
        torch.cuda.empty_cache()
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--json", type=Path)
    p.add_argument("--batches", default="1,32")
    p.add_argument("--modes", default="correctness,reference,fast_decode",
                   help="comma list of: correctness, reference, fast_decode")
    args = p.parse_args()
    device = torch.device("cuda:0")
    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    modes = args.modes.split(",")
    if "correctness" in modes:
        report["attention_equality"] = attention_equality(device)
        report["correctness"] = {mode: correctness(device, fast) for mode, fast in
                                 (("reference", False), ("fast_decode", True))}
        print("attention:", report["attention_equality"], flush=True)
        print("correctness:", report["correctness"], flush=True)
    batches = [int(b) for b in args.batches.split(",")]
    for mode, fast in (("reference", False), ("fast_decode", True)):
        if mode in modes:
            report[f"decode_{mode}"] = decode_speed(device, batches, fast)
            print(f"decode ({mode}):", json.dumps(report[f"decode_{mode}"]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    bad = "correctness" in report and (any(c["mismatches"] for c in report["correctness"].values())
                                       or not report["attention_equality"]["ok"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
