#!/usr/bin/env python3
"""vLLM's output options on a GPU (run on the GPU box, not in CI): the
built-in tiny model in float32 on CUDA, with the fast paths (decode graphs,
captured mixed steps) on, against the same engine on the CPU:

1. prompt_logprobs: a prompt's logprobs, ranks and top 3 beside a request
   that asks for none (its steps leave the captured mixed step for the
   eager one), within 1e-3 of the CPU's, and the greedy tokens equal;
2. allowed_token_ids: greedy and sampled tokens inside the allowed set;
3. bad_words: a two-token word of the free answer never written.

    python3 scripts/gpu_output_options_check.py [--json OUT] [--device cpu]

(--device cpu runs the same against itself: a smoke test of the script.)
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


def engine_on(device: str) -> Engine:
    model_dir = default_model_dir()
    model = load_model(model_dir, dtype="float32", device=device).model
    return Engine(model, Tokenizer.from_checkpoint(model_dir), EngineConfig(kv_cache_bytes=64 << 20),
                  torch.device(device))


def run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, dict]:
    """Run the requests together: per request its tokens and prompt logprobs."""
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, MultimodalPrompt(ids, [], []), [], params)
    out = {rid: {"tokens": [], "prompt": ()} for rid in requests}
    while engine.has_work():
        for o in engine.step():
            out[o.request_id]["tokens"] += o.new_token_ids
            out[o.request_id]["prompt"] = out[o.request_id]["prompt"] or o.prompt_logprobs
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json")
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    rng = np.random.default_rng(5)
    prompt = [int(t) for t in rng.integers(10, 450, 300)]
    other = [int(t) for t in rng.integers(10, 450, 40)]
    asks = {"asks": (prompt, SamplingParams(max_tokens=8, ignore_eos=True, prompt_logprobs=3)),
            "plain": (other, SamplingParams(max_tokens=8, ignore_eos=True))}
    gpu, cpu = run(engine_on(args.device), asks), run(engine_on("cpu"), asks)
    worst = max(abs(a[1] - b[1]) for a, b in zip(gpu["asks"]["prompt"], cpu["asks"]["prompt"]))
    result = {"prompt_logprobs": {
        "entries": len(gpu["asks"]["prompt"]), "expected": len(prompt) - 1, "max_abs_diff": worst,
        "ranks_equal": sum(a[2] == b[2] for a, b in zip(gpu["asks"]["prompt"], cpu["asks"]["prompt"])),
        "top_ids_equal": sum(a[3] == b[3] for a, b in zip(gpu["asks"]["prompt"], cpu["asks"]["prompt"])),
        "tokens_equal": gpu["asks"]["tokens"] == cpu["asks"]["tokens"],
        "plain_tokens_equal": gpu["plain"]["tokens"] == cpu["plain"]["tokens"]}}
    engine = engine_on(args.device)
    free = run(engine, {"free": (other, SamplingParams(max_tokens=12, ignore_eos=True))})["free"]["tokens"]
    allowed = tuple(sorted(set(range(60, 90)) - set(free)))
    restricted = run(engine, {
        "greedy": (other, SamplingParams(max_tokens=12, ignore_eos=True, allowed_token_ids=allowed)),
        "drawn": (other, SamplingParams(max_tokens=12, ignore_eos=True, allowed_token_ids=allowed,
                                        temperature=1.0, seed=1))})
    result["allowed_token_ids"] = {rid: set(r["tokens"]) <= set(allowed) for rid, r in restricted.items()}
    word = (free[2], free[3])
    banned = run(engine, {"bad": (other, SamplingParams(max_tokens=12, ignore_eos=True,
                                                         bad_words_token_ids=(word,)))})["bad"]["tokens"]
    result["bad_words"] = {"never_written": all((a, b) != word for a, b in zip(banned, banned[1:]))}
    ok = (result["prompt_logprobs"]["entries"] == len(prompt) - 1 and worst <= 1e-3
          and all(result["allowed_token_ids"].values()) and result["bad_words"]["never_written"])
    result["ok"] = ok
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
