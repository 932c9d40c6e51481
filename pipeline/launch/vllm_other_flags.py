"""The rest of `vllm serve`'s common flags, so that a vLLM unit's command
line meets a reason rather than argparse's "unrecognized arguments":

- ACCEPTED: their meaning already holds here at any value (what they ask
  for is always so, or is about a part this server does not have); each
  says why, in `--help` and docs/operations.md;
- REFUSED: features not served here; the flag, at any value, exits 2 in
  one line that says why and, where there is one, what to use instead.

The flags that are acted on are in vllm_flags.py, those that hold at one
value only in vllm_fixed_flags.py.
"""

from __future__ import annotations

import argparse

# How a flag takes its value: a switch, one value, or any number (argparse's nargs).
SWITCH, ONE, MANY = 0, 1, "*"

_GRAPHS = "CUDA graphs are captured by the generators for their own batch sizes; --enforce-eager turns them off"

# (flag, how it takes a value, why its meaning holds here)
ACCEPTED = (
    ("--root-path", ONE, "the proxy serves no pages whose links it would write; a reverse proxy in front strips "
     "its path prefix"),
    ("--uvicorn-log-level", ONE, "the proxy's HTTP server is aiohttp's, not uvicorn's; --log-level sets every "
     "stage's"),
    ("--disable-fastapi-docs", SWITCH, "the proxy serves no /docs, /redoc or /openapi.json pages"),
    ("--enable-request-id-headers", SWITCH, "every answer carries X-Request-Id here"),
    ("--max-log-len", ONE, "the request log lines print no prompt to cut"),
    ("--swap-space", ONE, "a preempted request is computed again, never swapped to the CPU (as in vLLM's V1 "
     "engine)"),
    ("--async-scheduling", SWITCH, "each decode step is planned while the last one runs (decode ahead, on by "
     "default)"),
    ("--disable-sliding-window", SWITCH, "the models served here attend to the whole context"),
    ("--disable-cascade-attn", SWITCH, "no cascade attention is used here"),
    ("--disable-custom-all-reduce", SWITCH, "a generator runs on one GPU: there is no all-reduce"),
    ("--max-parallel-loading-workers", ONE, "each stage loads its own weights"),
    ("--code-revision", ONE, "no checkpoint's own code is ever run"),
    ("--hf-token", ONE, "nothing is downloaded: a repo id is read from this machine's Hugging Face cache"),
    ("--mm-encoder-tp-mode", ONE, "the vision tower runs whole in each encoder, on one GPU: there is no tensor "
     "parallelism to split it by weights or by data"),
    ("--skip-mm-profiling", SWITCH, "no profiling run is made: each generator sizes its KV cache from the GPU's "
     "memory by formula (--gpu-memory-utilization)"),
    ("--interleave-mm-strings", SWITCH, "a string-format chat template gets each image's placeholder where the "
     "image was among the text, always (--chat-template-content-format)"),
    ("--log-error-stack", SWITCH, "the proxy logs the stack of every internal error (a 500) anyway"),
)

# (flag, how it takes a value, why it is refused)
REFUSED = (
    ("--quantization", ONE, "weights are served in the checkpoint's dtype (--dtype); quantized checkpoints are not "
     "served"),
    ("--enable-lora", SWITCH, "LoRA adapters are not served"),
    ("--lora-modules", MANY, "LoRA adapters are not served"),
    ("--speculative-config", ONE, "speculative decoding is not built"),
    ("--enable-sleep-mode", SWITCH, "stages do not sleep; stop the service instead"),
    ("--enable-prompt-embeds", SWITCH, "prompts are text or token ids"),
    ("--skip-tokenizer-init", SWITCH, "the proxy renders and tokenizes every prompt"),
    ("--otlp-traces-endpoint", ONE, "no OpenTelemetry traces are written; /metrics and the request log lines carry "
     "the timings"),
    ("--tool-server", ONE, "built-in tools are not served, function tools are"),
    ("--middleware", MANY, "no outside code is loaded into the proxy"),
    ("--headless", SWITCH, "the proxy always runs; start the stages yourself (python -m stages.X) for another "
     "layout"),
    ("--hf-overrides", ONE, "the checkpoint's config.json is read as it is"),
    ("--media-io-kwargs", ONE, "a video's sampling is set per request (mm_processor_kwargs fps or num_frames)"),
    ("--log-config-file", ONE, "logging is set by --log-level and --log-format"),
    ("--tokenizer", ONE, "the tokenizer is read from the model's folder"),
    ("--tokenizer-revision", ONE, "the tokenizer is the model snapshot's own (--revision)"),
    ("--compilation-config", ONE, _GRAPHS),
    ("--cuda-graph-sizes", MANY, _GRAPHS),
    ("--max-seq-len-to-capture", ONE, _GRAPHS),
    ("--max-cudagraph-capture-size", ONE, _GRAPHS),
    ("--mm-processor-cache-gb", ONE, "encoders keep embeddings, not processed inputs; their arena is the cache "
     "(--stage-arg encoder=--arena-mib=N)"),
    ("--disable-mm-preprocessor-cache", SWITCH, "the encoders' arena is both their cache and their handoff; it "
     "cannot be turned off"),
    ("--num-gpu-blocks-override", ONE, "size the KV cache with --kv-cache-memory-bytes (or --gpu-memory-utilization)"),
    ("--enable-log-outputs", SWITCH, "the request log lines carry neither prompts nor outputs"),
    ("--disable-chunked-mm-input", SWITCH, "a step's chunk may end inside an image's tokens, as by vLLM's "
     "default"),
    ("--enable-mm-embeds", SWITCH, "images and videos are sent as media; embeddings as input are not served"),
    ("--calculate-kv-scales", SWITCH, "the KV cache is kept in the model's dtype; there are no KV scales"),
    ("--kv-events-config", ONE, "KV cache events are not published"),
    ("--logits-processors", MANY, "no outside code is loaded into the generators"),
    ("--io-processor-plugin", ONE, "no outside code is loaded"),
    ("--reasoning-parser-plugin", ONE, "no outside code is loaded; --reasoning-parser names the built-in parsers"),
    ("--tool-parser-plugin", ONE, "no outside code is loaded; tool calls are parsed in the Hermes format"),
    ("--enable-tokenizer-info-endpoint", SWITCH, "there is no /tokenizer_info; /tokenize and /detokenize are "
     "served"),
    ("--disable-frontend-multiprocessing", SWITCH, "the proxy and the stages it serves are always processes of "
     "their own"),
    ("--h11-max-header-count", ONE, "the proxy's HTTP server is aiohttp's, with its own header limits, not "
     "uvicorn's h11"),
    ("--h11-max-incomplete-event-size", ONE, "the proxy's HTTP server is aiohttp's, with its own header limits, "
     "not uvicorn's h11"),
    ("--mm-processor-cache-type", ONE, "encoders keep embeddings, not processed inputs; their arena is the cache "
     "(--stage-arg encoder=--arena-mib=N)"),
    ("--mm-shm-cache-max-object-size-mb", ONE, "encoders keep embeddings, not processed inputs; their arena is "
     "the cache (--stage-arg encoder=--arena-mib=N)"),
)

ALL = ACCEPTED + REFUSED


def dest_of(flag: str) -> str:
    return flag[2:].replace("-", "_")


def add_other_flags(p: argparse.ArgumentParser) -> None:
    accepted = p.add_argument_group("vllm serve's flags whose meaning already holds here (accepted, no effect)")
    for flag, takes, why in ACCEPTED:
        _add(accepted, flag, takes, f"accepted: {why}")
    refused = p.add_argument_group("vllm serve's flags for what is not served here (each exits 2, saying why)")
    for flag, takes, why in REFUSED:
        _add(refused, flag, takes, f"refused: {why}")


def _add(group, flag: str, takes, help_text: str) -> None:
    if takes == SWITCH:
        group.add_argument(flag, action="store_true", default=None, help=help_text)
    else:
        group.add_argument(flag, nargs=None if takes == ONE else MANY, metavar="VALUE", help=help_text)


def check_other_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """p.error, naming the first refused flag given and why."""
    for flag, _, why in REFUSED:
        if getattr(args, dest_of(flag)) not in (None, False):
            p.error(f"{flag}: not served here: {why}")
