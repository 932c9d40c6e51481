#!/usr/bin/env python3
"""The decode step's cost of the logits processors and logprobs against
plain greedy, side by side in one run (issue 17): whole engine steps of a
Qwen2.5-VL-3B-shaped language model (random bf16 weights) at batch 32,
each setting in its own engine over the same prompts.

    python3 scripts/gpu_sampling_cost.py [--batch 32] [--steps 30] [--rounds 3] [--json OUT.json]
    python3 scripts/gpu_sampling_cost.py --device cpu --shape qwen2.5-vl-tiny --batch 4 --steps 3 --rounds 1   # smoke

Settings: greedy; greedy + repetition/frequency/presence penalties and
logit_bias; greedy + logprobs (top 5); all of them; all of them with a JSON
grammar mask (json_grammar: every measured step stays constrained); sampling (temperature, top_p, min_p, seeded)
with all of them. Prints step medians and the ratio to greedy, round by round (target:
<= 1.10 with penalties, logprobs and the JSON mask), then for each setting
where the time goes: the medians of the forward, the grammar fill, the
sampler, the logprobs and the matchers' consume, each timed between device syncs in extra steps after the
measured ones (the syncs undo the overlap of the fill with the forward, so
those steps run longer than the measured ones).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from unittest import mock

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.engine import choose as choose_module  # noqa: E402
from pipeline.engine.engine import Engine, EngineConfig  # noqa: E402
from pipeline.sampling_params import SamplingParams  # noqa: E402
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
    """An object whose one string must run 4096 characters: a random model
    would otherwise close the object in a few tokens, and every measured
    step must stay constrained."""
    import llguidance

    schema = {"type": "object", "properties": {"text": {"type": "string", "minLength": 4096}}, "required": ["text"]}
    return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides={"whitespace_flexible": False})


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


AHEAD = "/ahead"   # a setting's name with this suffix runs with EngineConfig.decode_ahead


def make_engine(model, tokenizer, device, batch: int, context: int, steps: int, extra: dict,
                ahead: bool = False, warm_up: bool = True) -> Engine:
    kv_bytes = (8 << 30) if device.type == "cuda" else (256 << 20)
    engine = Engine(model, tokenizer, EngineConfig(max_num_batched_tokens=max(8192, batch * context),
                                                   max_num_seqs=batch + 1, kv_cache_bytes=kv_bytes,
                                                   decode_ahead=ahead), device)
    vocab = min(150000, model.cfg.text.vocab_size)
    for i in range(batch):
        ids = [int(x) for x in np.random.default_rng(i).integers(0, vocab, context)]
        seed = extra.get("seed")   # one seed a request: seeded rows each keep their own generator
        params = SamplingParams(max_tokens=steps + 20, ignore_eos=True,
                                **{**extra, "seed": None if seed is None else seed + i})
        engine.add_request(f"r{i}", MultimodalPrompt(ids, [], []), [], params)
    for _ in range(4 if warm_up else 0):   # the prefill, then decodes until the graphs are captured
        engine.step()
    sync(device)
    return engine


def step_times(engine: Engine, device, steps: int) -> list[float]:
    """Each step's time as the engine's loop sees it, not synced: a step
    that waits for its tokens ends with the device idle, and one that runs
    ahead (decode_ahead) returns while the next forward runs, so in both the
    time of a step is the period of the loop."""
    sync(device)
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - started)
    sync(device)
    return times


def same_tokens(model, tokenizer, device, batch: int, context: int, steps: int) -> bool:
    """Greedy tokens of `steps` decode steps, from the engine that waits and from one that runs ahead."""
    got = []
    for ahead in (False, True):
        # No warm-up steps: their outputs would be dropped, and an engine that
        # runs ahead hands a step's tokens out one step later.
        engine = make_engine(model, tokenizer, device, batch, context, steps + 8, {}, ahead, warm_up=False)
        tokens: dict[str, list[int]] = defaultdict(list)
        for _ in range(steps):
            for out in engine.step():
                tokens[out.request_id] += out.new_token_ids
        got.append({rid: ids[:steps - 2] for rid, ids in tokens.items()})
        del engine
    return got[0] == got[1] and len(got[0]) == batch


def step_ms(engine: Engine, device, steps: int) -> float:
    return float(np.median(step_times(engine, device, steps)) * 1000)


def breakdown_ms(engine: Engine, device, steps: int, constrained: bool) -> dict[str, float]:
    """Medians over `steps` more steps of the time inside each piece of the
    step, and of the whole (synced) step; "rest" is what none of them holds
    (scheduling, consuming tokens, outputs)."""
    times: dict[str, list[float]] = defaultdict(list)

    def timed(name, fn):
        def run(*args, **kwargs):
            sync(device)   # what was queued before lands outside the piece
            started = time.perf_counter()
            result = fn(*args, **kwargs)
            sync(device)
            times[name].append(time.perf_counter() - started)
            return result
        return run

    with contextlib.ExitStack() as patches:
        patches.enter_context(mock.patch.object(engine.runner, "execute", timed("forward", engine.runner.execute)))
        patches.enter_context(mock.patch.object(choose_module, "sample_on_device",
                                                timed("sample", choose_module.sample_on_device)))
        patches.enter_context(mock.patch.object(choose_module, "logprob_table",
                                                timed("logprobs", choose_module.logprob_table)))
        if constrained:
            grammars = engine.grammars()
            patches.enter_context(mock.patch.object(grammars, "fill", timed("grammar_fill", grammars.fill)))
            patches.enter_context(mock.patch.object(grammars, "consume", timed("grammar_consume", grammars.consume)))
        step = step_ms(engine, device, steps)
    out = {name: float(np.median(values) * 1000) for name, values in times.items()}
    out["rest"] = step - sum(out.values())
    out["synced_step"] = step
    return out


def time_ms(fn, device, repeats: int = 50) -> float:
    """Median ms of fn() between device syncs."""
    times = []
    for _ in range(repeats):
        sync(device)
        started = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - started)
    return float(np.median(times) * 1000)


def pieces_ms(batch: int, vocab: int, device, dtype) -> dict[str, float]:
    """The logprobs' top-5, and the bitmask's unpack and fill against
    kernels/bitmask.py (CUDA only), side by side."""
    from pipeline.engine.grammar import unpack_bitmask

    logits = torch.randn(batch, vocab, device=device).to(dtype)
    out = {"topk5": time_ms(lambda: logits.topk(5, dim=-1), device)}
    words = torch.randint(-2**31, 2**31 - 1, (batch, (vocab + 31) // 32), dtype=torch.int64).to(torch.int32).to(device)
    scores = logits.float()
    out["mask_unpack_fill"] = time_ms(lambda: scores.masked_fill_(~unpack_bitmask(words, vocab), float("-inf")), device)
    if device.type == "cuda":
        from pipeline.kernels.bitmask import apply_bitmask

        rows = torch.arange(batch, device=device)
        out["mask_kernel"] = time_ms(lambda: apply_bitmask(scores, words, rows), device)
        fresh, reference = logits.float(), logits.float()
        apply_bitmask(fresh, words, rows)
        reference.masked_fill_(~unpack_bitmask(words, vocab), float("-inf"))
        out["mask_kernel_equal"] = float(torch.equal(fresh, reference))
    return out


def profile_steps(engine: Engine, device, steps: int = 10) -> str:
    """torch.profiler's table of `steps` engine steps, by self device time then self host time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        sync(device)
    table = prof.key_averages()
    by_device = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    text = table.table(sort_by=by_device, row_limit=18) + table.table(sort_by="self_cpu_time_total", row_limit=18)
    print(text, flush=True)
    return text


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=30, help="steps a setting measures in each round")
    p.add_argument("--rounds", type=int, default=3, help="rounds of every setting in turn")
    p.add_argument("--json", type=Path)
    p.add_argument("--device", default="cuda")
    p.add_argument("--shape", default="qwen2.5-vl-3b")
    p.add_argument("--profile", action="append", default=[], metavar="SETTING",
                   help="print torch.profiler's table of 10 steps of this setting (repeatable)")
    p.add_argument("--breakdown-steps", type=int, default=10, help="steps for the per-piece breakdown (0: none)")
    p.add_argument("--check-only", action="store_true", help="only the decode-ahead token check")
    p.add_argument("--settings", help="comma-separated setting names to run (default: all); greedy is always run")
    p.add_argument("--skip-check", action="store_true", help="no decode-ahead token check")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = random_model(args.shape, dtype, device).model
    tokenizer = Tokenizer.from_checkpoint(default_model_dir())
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    out = {"batch": args.batch, "context": args.context, "shape": args.shape, "device": name}
    out["pieces_ms"] = pieces_ms(args.batch, model.cfg.text.vocab_size, device, dtype)
    print("pieces: " + ", ".join(f"{k} {v:.3f}" for k, v in out["pieces_ms"].items()) + " ms", flush=True)
    settings = dict(SETTINGS)
    settings["penalties+logprobs5+json"] = dict(PENALTIES, logprobs=5, grammar=json_grammar())
    for name in ("greedy", "penalties+logprobs5", "penalties+logprobs5+json"):
        settings[name + AHEAD] = settings[name]
    if args.settings:
        wanted = {"greedy", *args.settings.split(",")}
        settings = {name: extra for name, extra in settings.items() if name in wanted}
    if args.skip_check:
        return _measure(args, model, tokenizer, device, settings, out)
    out["ahead_same_greedy_tokens"] = same_tokens(model, tokenizer, device, args.batch, args.context, 24)
    print(f"decode ahead: greedy tokens equal to the waiting engine's: {out['ahead_same_greedy_tokens']}", flush=True)
    if args.check_only:
        return 0 if out["ahead_same_greedy_tokens"] else 1
    return _measure(args, model, tokenizer, device, settings, out)

def _measure(args, model, tokenizer, device, settings: dict, out: dict) -> int:
    # One engine at a time: each takes its own KV cache and graphs (several
    # engines' graphs alive at once in one process hit an illegal memory
    # access on the H200, not yet understood). The settings take turns,
    # greedy first, `rounds` times over: a ratio is a setting's step median
    # over greedy's in the same round (the box drifts between rounds), and
    # the published ratio is the median of the rounds' ratios.
    medians: dict[str, list[float]] = defaultdict(list)
    for round_index in range(args.rounds):
        last = round_index == args.rounds - 1
        for name, extra in settings.items():
            engine = make_engine(model, tokenizer, device, args.batch, args.context,
                                 args.steps + (args.breakdown_steps if last else 0) + 12, extra, name.endswith(AHEAD))
            medians[name].append(step_ms(engine, device, args.steps))
            if last and name in args.profile:
                out[f"{name}_profile"] = profile_steps(engine, device)
            if last and args.breakdown_steps and not name.endswith(AHEAD):   # syncs would undo the overlap
                parts = out[f"{name}_breakdown_ms"] = breakdown_ms(engine, device, args.breakdown_steps,
                                                                   "grammar" in extra)
                print(f"    {name} inside (synced): " + ", ".join(f"{k} {v:.3f}" for k, v in parts.items())
                      + " ms", flush=True)
            del engine   # its KV cache and graphs go before the next setting's engine is built
        print(f"round {round_index + 1}: " + ", ".join(f"{k} {v[-1]:.3f}" for k, v in medians.items()) + " ms",
              flush=True)
    for name, values in medians.items():
        # Each against greedy in the same engine mode (an "/ahead" setting against greedy/ahead).
        base = medians["greedy" + (AHEAD if name.endswith(AHEAD) else "")]
        ratios = [value / greedy for value, greedy in zip(values, base)]
        out[f"{name}_ms"] = float(np.median(values))
        out[f"{name}_vs_greedy"] = float(np.median(ratios))
        out[f"{name}_round_ratios"] = ratios
        print(f"{name}: {out[f'{name}_ms']:.3f} ms a step, {out[f'{name}_vs_greedy']:.3f}x greedy "
              f"(rounds: {', '.join(f'{r:.3f}' for r in ratios)})", flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0



if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
