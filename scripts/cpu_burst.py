#!/usr/bin/env python3
"""Issue 6's CPU acceptance: a burst of 40 one-image 640x640 requests (32 text
and 16 output tokens) against 1E1PD and aggregated on the tiny model, side by
side, then a per-request profile of our own work against model compute.

    python scripts/cpu_burst.py [--out /tmp/cpu-burst] [--prompts 40]

1E1PD is `bin/epd-launch --encoders 1 --generators 1`; aggregated is
`--mode aggregated --generators 2` (the same number of model processes).
Each gets a short warm-up burst first. Prints request throughput and TTFT
p50 of each, the ratios, and the profile: per request, in this process,
the proxy's build work (parse the JSON body, decode the data URL, read the
image header, hash, render and tokenize, encode the stage messages) against
the encoder's work (decode and preprocess the image, vision forward) and
the generator's (prefill and 15 decode steps of the language model).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402

from pipeline.bench.dataset import RandomMMConfig, sample_requests  # noqa: E402
from pipeline.bench.launched import LaunchedStack, StackError, read_json, run_bench  # noqa: E402

LAYOUTS = {"1E1PD": ["--encoders", "1", "--generators", "1"],
           "aggregated": ["--mode", "aggregated", "--generators", "2"]}
PROXY_BUILD = "proxy build (parse, fetch, hash, tokenize, encode messages)"
DECODE = "encoder: JPEG decode + preprocess 640x640"
IPC = "IPC: the request's messages over zmq ipc:// + its embedding through a shm arena"
OURS = (PROXY_BUILD, IPC)
WORKLOAD = ["--random-input-len", "32", "--random-output-len", "16", "--random-mm-base-items-per-request", "1",
            "--random-mm-bucket-config", "{(640, 640, 1): 1.0}", "--request-rate", "inf", "--no-progress"]


def run_burst(name: str, args: argparse.Namespace) -> dict:
    threads = [f"--stage-arg={role}=--cpu-threads={args.threads}" for role in ("encoder", "generator")]
    stack = LaunchedStack([*LAYOUTS[name], "--device", "cpu", *threads], args.out / "logs" / name)
    out = args.out / f"{name}.json"
    bench = ["--base-url", stack.base_url, *WORKLOAD, "--num-prompts", str(args.prompts), "--json", str(out)]
    try:
        stack.start(ready_timeout=120)
        warmup = ["--base-url", stack.base_url, *WORKLOAD, "--num-prompts", "4", "--seed", "1000"]
        run_bench(warmup, 120, args.out / "logs" / f"{name}-bench.log")
        run_bench(bench, 300, args.out / "logs" / f"{name}-bench.log")
    finally:
        stack.stop()
    result = read_json(out)
    if not result or result.get("failed"):
        raise StackError(f"{name}: the burst failed; see {args.out / 'logs'}")
    result["commands"] = [shlex.join(["bin/epd-launch", *stack.argv[2:]]),
                          shlex.join(["bin/epd-bench", *bench])]
    return result


def per_request_ms(fn, repeats: int) -> float:
    """Median wall milliseconds of fn() over `repeats` calls, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def ipc_per_request(work, embedding, repeats: int) -> float:
    """One request's inter-process traffic, timed through real sockets and a
    real arena in this process: the encode job (with the JPEG) and the
    generate request, the ready message and the lease release, 16 token
    deltas, each sent and received over a zmq ipc:// pair; the embedding
    written into a shm arena and read back out."""
    import tempfile

    import torch
    import zmq

    from pipeline import protocol, transport
    from pipeline.arena.reader import ArenaReader
    from pipeline.arena.store import ArenaStore

    folder = tempfile.mkdtemp(prefix="epd-ipc-")
    ctx = zmq.Context()
    inbox = transport.make_socket(ctx, zmq.PULL, f"ipc://{folder}/in.sock", bind=True)
    outbox = transport.make_socket(ctx, zmq.PUSH, f"ipc://{folder}/in.sock", bind=False)
    store = ArenaStore(64 << 20, 64 << 10, torch.device("cpu"), f"burst-ipc-{id(work)}", 60.0)
    reader = ArenaReader()
    reader.open(store.info)
    counter = iter(range(1_000_000))

    def one_request() -> None:
        key = f"k{next(counter)}"
        entry = store.reserve(key, tuple(embedding.shape), embedding.dtype)
        store.write(entry, embedding)
        store.index.mark_ready(key)
        lease = store.index.lease(key, "gen", "r")
        ready = protocol.EmbeddingReady("j", "r", key, store.handle(entry), lease.lease_id, "enc")
        deltas = [protocol.TokenDelta("r", (i,), "word ") for i in range(16)]
        messages = [work.request, *work.jobs, ready, protocol.ReleaseLease((lease.lease_id,), "gen"), *deltas]
        for message in messages:
            outbox.send(protocol.encode(message))
            protocol.decode(inbox.recv())
        reader.read(ready.handle)
        store.index.release(lease.lease_id)
        store.index.evict(key)

    try:
        return per_request_ms(one_request, repeats)
    finally:
        reader.close()
        store.close()
        inbox.close()
        outbox.close()
        ctx.term()


def profile(repeats: int, threads: int) -> dict[str, float]:
    """Per-request milliseconds of each piece, in this process, with the
    stages' thread count: our overhead (proxy build) against the encoder's
    and the generator's compute."""
    import torch

    torch.set_num_threads(threads)
    from pipeline import protocol
    from pipeline.generate import GenerationLimits, greedy_generate
    from pipeline.hashing import media_salt
    from pipeline.media.pillow_backend import PillowBackend
    from pipeline.models.loader import load_model
    from pipeline.models.tiny import default_model_dir
    from pipeline.processing.processor import MultimodalPrompt, Processor
    from pipeline.proxy.api_types import parse_body
    from pipeline.proxy.media_fetch import FetchPolicy
    from pipeline.proxy.requests import ModelInfo, chat_work

    model_dir = default_model_dir()
    loaded = load_model(model_dir)
    processor = Processor.from_checkpoint(model_dir, loaded.config.image_token_id)
    info = ModelInfo("tiny", processor, loaded.config.max_context, media_salt("tiny", processor.image_config.settings_key()))
    dataset = RandomMMConfig(1, 32, 16, 0.0, 1, 0.0, {(640, 640, 1): 1.0}, 0.0)
    (request,) = sample_requests(dataset, np.random.default_rng(0))
    body = json.dumps({"model": "tiny", "max_tokens": 16, "ignore_eos": True, "stream": True, "messages": [
        {"role": "user", "content": [{"type": "text", "text": request.prompt},
                                     {"type": "image_url", "image_url": {"url": request.image_urls[0]}}]}]}).encode()
    loop = asyncio.new_event_loop()

    def proxy_build() -> None:
        work = loop.run_until_complete(chat_work(parse_body(body, "chat"), info, FetchPolicy(), "r", "ipc://x"))
        protocol.encode(work.request)
        for job in work.jobs:
            protocol.encode(job)

    jpeg = base64.b64decode(request.image_urls[0].split(",", 1)[1])
    media = PillowBackend("cpu", num_threads=1)
    (decoded,) = media.decode([jpeg], processor.image_config)
    model = loaded.model
    prompt = processor.chat_prompt(json.loads(body)["messages"], [(640, 640)])
    # The same ids without image spans: the language model's work alone (the
    # placeholders embed as ordinary tokens).
    text_only = MultimodalPrompt(prompt.token_ids, [], [])
    limits = GenerationLimits(16, frozenset(), ignore_eos=True)
    work = loop.run_until_complete(chat_work(parse_body(body, "chat"), info, FetchPolicy(), "r", "ipc://x"))
    with torch.inference_mode():
        embedding = model.encode_images(decoded.pixel_values, [decoded.grid])[0]
        timings = {
            PROXY_BUILD: per_request_ms(proxy_build, repeats),
            IPC: ipc_per_request(work, embedding, repeats),
            DECODE: per_request_ms(
                lambda: media.decode([jpeg], processor.image_config), repeats),
            "encoder: vision forward": per_request_ms(
                lambda: model.encode_images(decoded.pixel_values, [decoded.grid]), repeats),
            f"generator: prefill {len(prompt.token_ids)} tokens + 15 decode steps": per_request_ms(
                lambda: greedy_generate(model, text_only, None, limits), repeats),
        }
    media.close()
    loop.close()
    return timings


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("/tmp/cpu-burst"))
    p.add_argument("--prompts", type=int, default=40)
    p.add_argument("--profile-repeats", type=int, default=20)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads per stage (--cpu-threads); more than the cores oversubscribe them")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        results = {name: run_burst(name, args) for name in LAYOUTS}
    except StackError as exc:
        print(f"cpu_burst: error: {exc}", file=sys.stderr)
        return 1
    for name, r in results.items():
        print(f"{name:>10}: {r['completed']}/{r['num_prompts']} done in {r['duration']:.2f} s, "
              f"request throughput {r['request_throughput']:.2f} req/s, TTFT p50 {r['median_ttft_ms']:.0f} ms, "
              f"p99 {r['p99_ttft_ms']:.0f} ms, E2EL p50 {r['median_e2el_ms']:.0f} ms")
        for command in r["commands"]:
            print(f"{'':>12}{command}")
    epd, agg = results["1E1PD"], results["aggregated"]
    print(f"1E1PD/aggregated: request throughput {epd['request_throughput'] / agg['request_throughput']:.2f}x, "
          f"TTFT p50 {epd['median_ttft_ms'] / agg['median_ttft_ms']:.2f}x")
    timings = profile(args.profile_repeats, args.threads)
    print(f"per-request profile (median ms, one process, {args.threads} thread(s)):")
    for label, ms in timings.items():
        print(f"  {ms:8.2f}  {label}")
    ours = sum(timings[label] for label in OURS)
    model_ms = sum(ms for label, ms in timings.items() if label not in (*OURS, DECODE))
    print(f"  proxy build + IPC is {100 * ours / model_ms:.1f}% of the model compute per request "
          f"(vision forward + prefill + decode: {model_ms:.1f} ms)")
    summary = {"bursts": results, "profile_ms": timings}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
