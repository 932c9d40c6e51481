#!/usr/bin/env python3
"""KV block sizes other than 16 on a GPU (run on the GPU box, not in CI):
the built-in tiny model in float32 on CUDA, fast paths on (decode graphs,
captured mixed steps, the Triton paged-attention kernels), the same batch of
requests (prompts of 5 to 700 tokens, one arriving while the others decode)
at each block size, against the CPU at block size 16: the greedy tokens equal.

    python3 scripts/gpu_block_size_check.py [--json OUT] [--device cpu] [--sizes 1 8 16 32 64 128]
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from pipeline.engine.engine import Engine, EngineConfig
from pipeline.models.loader import load_model
from pipeline.models.tiny import default_model_dir
from pipeline.processing.processor import MultimodalPrompt
from pipeline.processing.tokenizer import Tokenizer
from pipeline.sampling_params import SamplingParams


def tokens_at(device: str, block_size: int, prompts: list[list[int]]) -> dict[str, list[int]]:
    model_dir = default_model_dir()
    model = load_model(model_dir, dtype="float32", device=device).model
    engine = Engine(model, Tokenizer.from_checkpoint(model_dir),
                    EngineConfig(block_size=block_size, kv_cache_bytes=64 << 20, max_num_batched_tokens=256),
                    torch.device(device))
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    out = {f"r{i}": [] for i in range(len(prompts))}
    for i, ids in enumerate(prompts[:-1]):
        engine.add_request(f"r{i}", MultimodalPrompt(ids, [], []), [], params)
    steps = 0
    while engine.has_work():
        if steps == 6:   # a late prompt: its chunks run beside the others' decodes
            engine.add_request(f"r{len(prompts) - 1}", MultimodalPrompt(prompts[-1], [], []), [], params)
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
        steps += 1
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json")
    p.add_argument("--device", default="cuda")
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 16, 32, 64, 128])
    args = p.parse_args()
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(10, 450, n)] for n in (5, 17, 130, 700, 260)]
    expected = tokens_at("cpu", 16, prompts)
    result = {}
    for size in args.sizes:
        try:
            found = tokens_at(args.device, size, prompts)
            result[str(size)] = {"equal": sum(found[r] == expected[r] for r in expected), "of": len(expected)}
        except Exception as exc:   # one size failing does not hide the others
            result[str(size)] = {"error": f"{type(exc).__name__}: {exc}"}
        print(size, result[str(size)], flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    ok = all(r.get("equal") == r.get("of") for r in result.values())
    print("all equal" if ok else "NOT all equal")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
