#!/usr/bin/env python3
"""The decode step's cost of the logits processors and logprobs against
plain greedy, side by side in one run (issue 17): whole engine steps of a
Qwen2.5-VL-3B-shaped language model (random bf16 weights) at batch 32,
each setting in its own engine over the same prompts.

    python3 scripts/gpu_sampling_cost.py [--batch 32] [--steps 40] [--json OUT.json]

Settings: greedy; greedy + repetition/frequency/presence penalties and
logit_bias; greedy + logprobs (top 5); all of them; all of them with a JSON
grammar mask (any object: the random model writes one key for ever, so
every step stays constrained); sampling (temperature, top_p, min_p, seeded)
with all of them. Prints step medians and the ratio to greedy (target:
<= 1.10 with penalties, logprobs and the JSON mask).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.engine.engine import Engine, EngineConfig  # noqa: E402
from pipeline.engine.request import SamplingParams  # noqa: E402
from pipeline.models.shapes import random_model  # noqa: E402
from pipeline.models.tiny import default_model_dir  # noqa: E402
from pipeline.processing.processor import MultimodalPrompt  # noqa: E402
from pipeline.processing.tokenizer import Tokenizer  # noqa: E402

PENALTIES = dict(repetition_penalty=1.1, frequency_penalty=0.3, presence_penalty=0.2,
                 logit_bias=((11, 2.0), (220, -1.0)))
SETTINGS = {
    "greedy": {},
    "penalties": PENALTIES,
    "logprobs5": dict(logprobs=5),
    "penalties+logprobs5": dict(PENALTIES, logprobs=5),
    "sampled+all": dict(PENALTIES, logprobs=5, temperature=0.8, top_p=0.9, min_p=0.05, seed=7),
}


def json_grammar() -> str:
    import llguidance

    return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides={"whitespace_flexible": False})


def step_ms(model, tokenizer, device, batch: int, context: int, steps: int, extra: dict) -> float:
    engine = Engine(model, tokenizer, EngineConfig(max_num_batched_tokens=max(8192, batch * context),
                                                   max_num_seqs=batch + 1, kv_cache_bytes=8 << 30), device)
    for i in range(batch):
        ids = [int(x) for x in np.random.default_rng(i).integers(0, 150000, context)]
        seed = extra.get("seed")   # one seed a request: seeded rows each keep their own generator
        params = SamplingParams(max_tokens=steps + 20, ignore_eos=True,
                                **{**extra, "seed": None if seed is None else seed + i})
        engine.add_request(f"r{i}", MultimodalPrompt(ids, [], []), [], params)
    for _ in range(4):   # the prefill, then decodes until the graphs are captured
        engine.step()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return float(np.median(times) * 1000)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    device = torch.device("cuda")
    model = random_model("qwen2.5-vl-3b", torch.bfloat16, device).model
    tokenizer = Tokenizer.from_checkpoint(default_model_dir())
    out = {"batch": args.batch, "context": args.context, "device": torch.cuda.get_device_name(device)}
    settings = dict(SETTINGS)
    settings["penalties+logprobs5+json"] = dict(PENALTIES, logprobs=5, grammar=json_grammar())
    for name, extra in settings.items():
        out[f"{name}_ms"] = step_ms(model, tokenizer, device, args.batch, args.context, args.steps, extra)
        out[f"{name}_vs_greedy"] = out[f"{name}_ms"] / out["greedy_ms"]
        print(f"{name}: {out[f'{name}_ms']:.3f} ms a step ({out[f'{name}_vs_greedy']:.3f}x greedy)", flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
