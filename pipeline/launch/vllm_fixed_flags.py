"""`vllm serve` flags whose meaning holds here at one value only: epd-launch
takes each so that a vLLM unit carries over, at that value, and refuses any
other in one line that says what to use instead (a flag is never silently
dropped; pipeline/launch/vllm_flags.py has the flags that are acted on)."""

from __future__ import annotations

import argparse

# (flag, short form, type, the values that hold here, why another does not)
FIXED = (
    ("--tensor-parallel-size", "-tp", int, (1,), "a generator runs on one GPU here; use --generators N for more "
     "generators"),
    ("--pipeline-parallel-size", "-pp", int, (1,), "a generator runs on one GPU here; use --generators N for more "
     "generators"),
    ("--data-parallel-size", "-dp", int, (1,), "each generator is one engine, as a data-parallel rank is; use "
     "--generators N"),
    ("--kv-cache-dtype", None, str, ("auto",), "the KV cache is kept in the model's dtype"),
    ("--load-format", None, str, ("auto", "safetensors"), "checkpoints are read from their safetensors files"),
    ("--cpu-offload-gb", None, float, (0,), "weights stay on their stage's GPU"),
    ("--api-server-count", None, int, (1,), "one proxy process serves the API"),
    ("--tokenizer-mode", None, str, ("auto", "hf"), "the tokenizer is the checkpoint's tokenizer.json, read by the "
     "tokenizers library"),
    ("--model-impl", None, str, ("auto",), "the model code is this package's own"),
    ("--config-format", None, str, ("auto", "hf"), "checkpoints are read from their Hugging Face config.json"),
    ("--logprobs-mode", None, str, ("raw_logprobs",), "logprobs are the model's own distribution, before any "
     "sampling option changes it"),
    ("--distributed-executor-backend", None, str, ("mp", "uni"), "each generator is one process on one GPU"),
    ("--response-role", None, str, ("assistant",), "chat answers are the assistant's turn"),
    ("--max-num-partial-prefills", None, int, (1,), "prompts are prefilled in chunks side by side within "
     "--max-num-batched-tokens, with no separate cap on how many are partway"),
    ("--max-long-partial-prefills", None, int, (1,), "prompts are prefilled in chunks side by side within "
     "--max-num-batched-tokens, with no separate cap on how many are partway"),
    ("--long-prefill-token-threshold", None, int, (0,), "a prompt's chunk in a step is bounded by "
     "--max-num-batched-tokens alone"),
    ("--prefix-caching-hash-algo", None, str, ("xxhash",), "prefix-cached blocks are named by a chained "
     "xxh3-128 hash (pipeline/engine/prefix_cache.py)"),
    ("--guided-decoding-backend", None, str, ("auto", "guidance"), "grammars are enforced by llguidance (vLLM's "
     "guidance backend)"),
)


def add_fixed_flags(group) -> None:
    for flag, short, kind, values, _ in FIXED:
        names = (flag, short) if short else (flag,)
        group.add_argument(*names, type=kind, metavar="|".join(map(str, values)),
                           help=f"accepted at {' or '.join(map(str, values))} only")
    group.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                       help="accepted: prefill is always chunked here (--max-num-batched-tokens a step)")
    group.add_argument("--disable-uvicorn-access-log", action="store_true",
                       help="accepted: the proxy writes no access log (its per-request lines are "
                       "--disable-log-requests')")


def check_fixed_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """p.error, naming the flag and the value, for one whose meaning does not hold here."""
    for flag, _, _, values, why in FIXED:
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None and value not in values:
            p.error(f"{flag} {value}: {why}")
    if args.enable_chunked_prefill is False:
        p.error("--no-enable-chunked-prefill: prefill is always chunked here; a step computes at most "
                "--max-num-batched-tokens tokens")
