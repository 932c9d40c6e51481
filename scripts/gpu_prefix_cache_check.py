#!/usr/bin/env python3
"""Prefix caching on a GPU (EngineConfig.prefix_caching; run on the GPU box,
not in CI):

1. tokens: the built-in tiny model in float32 on CUDA. Prompts that share
   starts (one prompt, the same again, it with more text after, another
   that shares its first 100 tokens, and a chat's next turn: the first
   prompt, its answer, more text), greedy: the same tokens with prefix
   caching on and off, and on, hits for the shared starts;
2. speed: the Qwen2.5-VL-3B language model (random bf16 weights), a
   2544-token prompt (4 images of 640x640 and 400 words take as many): the
   time to its first token cold and again from the cache, measured in this
   one run, and whether the repeat's greedy tokens equal the cold run's;
   and a next turn (that prompt, its 150-token answer, 50 more tokens)
   against a cold prompt as long.

    python3 scripts/gpu_prefix_cache_check.py [--json OUT]
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


def run_one(engine: Engine, rid: str, ids: list[int], max_tokens: int) -> tuple[list[int], float]:
    """Greedy tokens of one request run alone, and seconds to its first token."""
    torch.cuda.synchronize()
    begun = time.perf_counter()
    engine.add_request(rid, MultimodalPrompt(ids, [], []), [], SamplingParams(max_tokens=max_tokens,
                                                                              ignore_eos=True))
    tokens: list[int] = []
    first = None
    while engine.has_work():
        for out in engine.step():
            tokens += out.new_token_ids
            if first is None and tokens:
                first = time.perf_counter() - begun
    return tokens, first


def tiny_tokens(caching: bool) -> tuple[list[list[int]], int]:
    model_dir = default_model_dir()
    model = load_model(model_dir, dtype="float32", device="cuda").model
    engine = Engine(model, Tokenizer.from_checkpoint(model_dir),
                    EngineConfig(kv_cache_bytes=256 << 20, prefix_caching=caching), CUDA)
    rng = np.random.default_rng(9)
    base = [int(t) for t in rng.integers(10, 450, 300)]
    other = base[:100] + [int(t) for t in rng.integers(10, 450, 150)]
    prompts = [base, base, base + [int(t) for t in rng.integers(10, 450, 40)], other]
    outputs = [run_one(engine, f"r{i}", ids, 30)[0] for i, ids in enumerate(prompts)]
    turn = base + outputs[0] + [int(t) for t in rng.integers(10, 450, 20)]   # its answer's blocks cached
    outputs.append(run_one(engine, "next-turn", turn, 30)[0])
    return outputs, engine.scheduler.prefix.hits if caching else 0


def shape_ttft() -> dict:
    model_dir = stage_model_dir(None, "qwen2.5-vl-3b")
    model = load_stage_model(model_dir, "qwen2.5-vl-3b", "bfloat16", CUDA, part="language")
    engine = Engine(model, Tokenizer.from_checkpoint(model_dir),
                    EngineConfig(max_num_seqs=64, kv_cache_bytes=8 << 30), CUDA)
    rng = np.random.default_rng(3)
    run_one(engine, "warm", [int(t) for t in rng.integers(10, 100_000, 2544)], 4)   # kernels, allocator
    result = {"cold_ms": [], "cached_ms": [], "tokens_equal": []}
    for i in range(3):
        ids = [int(t) for t in rng.integers(10, 100_000, 2544)]
        cold_tokens, cold = run_one(engine, f"cold{i}", ids, 16)
        again_tokens, cached = run_one(engine, f"again{i}", ids, 16)
        result["cold_ms"].append(round(cold * 1e3, 2))
        result["cached_ms"].append(round(cached * 1e3, 2))
        result["tokens_equal"].append(cold_tokens == again_tokens)
    result["next_turn_cold_ms"], result["next_turn_ms"] = [], []
    for i in range(3):
        ids = [int(t) for t in rng.integers(10, 100_000, 2544)]
        answer, _ = run_one(engine, f"turn{i}", ids, 150)
        turn = ids + answer + [int(t) for t in rng.integers(10, 100_000, 50)]
        _, cold = run_one(engine, f"cold-turn{i}", [int(t) for t in rng.integers(10, 100_000, len(turn))], 4)
        _, cached = run_one(engine, f"next-turn{i}", turn, 4)
        result["next_turn_cold_ms"].append(round(cold * 1e3, 2))
        result["next_turn_ms"].append(round(cached * 1e3, 2))
    result["hits"], result["queries"] = engine.scheduler.prefix.hits, engine.scheduler.prefix.queries
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    with torch.inference_mode():
        (on, hits), (off, _) = tiny_tokens(True), tiny_tokens(False)
        equal = on == off
        print(f"tiny model, 4 prompts sharing starts x 30 greedy tokens: caching on equal to off: {equal}; "
              f"hits {hits} tokens", flush=True)
        speed = shape_ttft()
    ratios = [c / h for c, h in zip(speed["cold_ms"], speed["cached_ms"])]
    print(f"3B, 2544-token prompt, first token: cold {speed['cold_ms']} ms, from the cache {speed['cached_ms']} ms "
          f"({', '.join(f'{r:.1f}x' for r in ratios)}); repeat's 16 greedy tokens equal: {speed['tokens_equal']}",
          flush=True)
    print(f"3B, a next turn of {2544 + 150 + 50} tokens, first token: cold {speed['next_turn_cold_ms']} ms, "
          f"its prompt and answer cached {speed['next_turn_ms']} ms", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tiny_tokens_equal": equal, "tiny_hits": hits, "shape_ttft": speed}, f, indent=1)
    return 0 if equal and hits > 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
