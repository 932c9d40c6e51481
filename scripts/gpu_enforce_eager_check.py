#!/usr/bin/env python3
"""--enforce-eager on a GPU (EngineConfig.cuda_graphs=False; run on the GPU
box, not in CI): the same engine with and without CUDA graphs.

1. tokens: the built-in tiny model in float32 on CUDA, 6 requests of
   different lengths batched, greedy: equal with and without graphs;
2. speed: the Qwen2.5-VL-3B language model (random bf16 weights) decoding
   batches of 1 and 32 (1024-token contexts): a step's time without graphs
   over its time with them, both measured in this one run.

    python3 scripts/gpu_enforce_eager_check.py [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from pipeline.engine.engine import Engine, EngineConfig
from pipeline.models.loader import load_model
from pipeline.models.stage_model import load_stage_model, stage_model_dir
from pipeline.models.tiny import default_model_dir
from pipeline.processing.processor import MultimodalPrompt
from pipeline.processing.tokenizer import Tokenizer
from pipeline.sampling_params import SamplingParams

CUDA = torch.device("cuda", 0)


def run_all(engine: Engine, prompts: list[list[int]], max_tokens: int) -> dict[str, list[int]]:
    for i, ids in enumerate(prompts):
        engine.add_request(f"r{i}", MultimodalPrompt(ids, [], []), [], SamplingParams(max_tokens=max_tokens,
                                                                                      ignore_eos=True))
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_work():
        for step in engine.step():
            out[step.request_id] += step.new_token_ids
    return out


def tiny_tokens(graphs: bool) -> dict[str, list[int]]:
    model_dir = default_model_dir()
    model = load_model(model_dir, dtype="float32", device="cuda").model
    engine = Engine(model, Tokenizer.from_checkpoint(model_dir),
                    EngineConfig(kv_cache_bytes=256 << 20, cuda_graphs=graphs), CUDA)
    rng = np.random.default_rng(5)
    prompts = [[int(t) for t in rng.integers(10, 450, n)] for n in (7, 33, 120, 64, 300, 18)]
    return run_all(engine, prompts, 40)


def decode_step_s(engine: Engine, batch: int, steps: int = 40) -> float:
    rng = np.random.default_rng(batch)
    for i in range(batch):
        ids = [int(t) for t in rng.integers(10, 100_000, 1024)]
        engine.add_request(f"d{batch}-{i}", MultimodalPrompt(ids, [], []), [],
                           SamplingParams(max_tokens=10_000, ignore_eos=True))
    started = set()
    while len(started) < batch:   # every sequence past its prefill
        started.update(out.request_id for out in engine.step())
    for _ in range(10):
        engine.step()
    torch.cuda.synchronize()
    begun = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - begun) / steps
    for i in range(batch):
        engine.abort(f"d{batch}-{i}")
    while engine.has_work():
        engine.step()
    return seconds


def shape_speed(graphs: bool) -> dict[str, float]:
    model_dir = stage_model_dir(None, "qwen2.5-vl-3b")
    model = load_stage_model(model_dir, "qwen2.5-vl-3b", "bfloat16", CUDA, part="language")
    engine = Engine(model, Tokenizer.from_checkpoint(model_dir),
                    EngineConfig(max_num_seqs=64, kv_cache_bytes=8 << 30, cuda_graphs=graphs), CUDA)
    result = {f"decode{b}_ms": decode_step_s(engine, b) * 1e3 for b in (1, 32)}
    del engine, model
    torch.cuda.empty_cache()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    with torch.inference_mode():
        graphs, eager = tiny_tokens(True), tiny_tokens(False)
        equal = graphs == eager
        print(f"tiny model, 6 requests x 40 greedy tokens: eager equal to graphs: {equal}", flush=True)
        speed = {"graphs": shape_speed(True), "eager": shape_speed(False)}
    for key in speed["graphs"]:
        print(f"3B {key}: graphs {speed['graphs'][key]:.2f}, eager {speed['eager'][key]:.2f} "
              f"({speed['eager'][key] / speed['graphs'][key]:.2f}x)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tokens_equal": equal, "speed": speed}, f, indent=1)
    return 0 if equal else 1


if __name__ == "__main__":
    raise SystemExit(main())
