#!/usr/bin/env python3
"""What the proxy adds to time-to-first-token, on the CPU with the tiny model.

    python scripts/bench_proxy_overhead.py [--requests 200]

Starts one generator and a proxy in front of it. Alternates, request by
request: (a) a streaming chat completion through the proxy's HTTP API, timed
from sending the request to receiving the first content chunk; (b) the same
prompt, already tokenized, sent straight to the generator as a
GenerateRequest over ZeroMQ, timed to the first TokenDelta with text. The difference of
the medians is the proxy's added latency (HTTP, JSON, chat template,
tokenization, one more ZeroMQ hop, SSE).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import httpx  # noqa: E402
import zmq  # noqa: E402

from pipeline import protocol, transport  # noqa: E402
from pipeline.models.tiny import default_model_dir  # noqa: E402
from pipeline.processing.processor import Processor  # noqa: E402
from stack import Stack  # noqa: E402


def through_proxy(client: httpx.Client, url: str, text: str) -> float:
    body = {"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 2,
            "temperature": 0, "stream": True, "ignore_eos": True}
    start = time.perf_counter()
    first = None
    with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            # The first chunk after the role-only one carries the first token.
            if first is None and line.startswith("data: {") and '"role"' not in line:
                first = time.perf_counter()
    return first - start


def direct(out: zmq.Socket, inbox: zmq.Socket, me: str, ids: list[int], rid: str) -> float:
    request = protocol.GenerateRequest(rid, tuple(ids), (), (), (), protocol.Sampling(2, ignore_eos=True), me)
    start = time.perf_counter()
    out.send(protocol.encode(request))
    first = None
    while True:
        delta = protocol.decode(inbox.recv())
        # As a client sees it: the first delta that carries text (a token that
        # ends inside a UTF-8 character yields no text yet, in either path).
        if first is None and (delta.text or delta.finished):
            first = time.perf_counter()
        if delta.finished:
            return first - start


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=200)
    args = p.parse_args()
    model_dir = default_model_dir()
    processor = Processor.from_checkpoint(model_dir, 0)
    run = Path(tempfile.mkdtemp(prefix="epd-bench-"))
    stack = Stack(run, model_dir, encoders=0, generators=1, aggregated=True)
    ctx = zmq.Context()
    me = f"ipc://{run}/bench.sock"
    inbox = transport.make_socket(ctx, zmq.PULL, me, bind=True)
    out = transport.make_socket(ctx, zmq.PUSH, f"ipc://{run}/gen0.sock", bind=False)
    try:
        stack.wait_healthy()
        client = httpx.Client(timeout=60)
        proxy_ms, direct_ms = [], []
        for i in range(args.requests + 20):
            text = f"Request number {i}: say something."
            ids = processor.chat_prompt([{"role": "user", "content": text}], []).token_ids
            a = through_proxy(client, stack.base_url, text)
            b = direct(out, inbox, me, ids, f"direct-{i}")
            if i >= 20:  # warm-up
                proxy_ms.append(a * 1000)
                direct_ms.append(b * 1000)
        p50p, p50d = statistics.median(proxy_ms), statistics.median(direct_ms)
        p99 = lambda xs: sorted(xs)[int(0.99 * len(xs)) - 1]  # noqa: E731
        print(f"TTFT through the proxy: p50 {p50p:.3f} ms, p99 {p99(proxy_ms):.3f} ms")
        print(f"TTFT straight to the generator: p50 {p50d:.3f} ms, p99 {p99(direct_ms):.3f} ms")
        print(f"proxy added latency (p50 difference): {p50p - p50d:.3f} ms over {len(proxy_ms)} requests")
    finally:
        inbox.close()
        out.close()
        ctx.term()
        stack.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
