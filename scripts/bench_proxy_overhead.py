#!/usr/bin/env python3
"""What the proxy adds to time-to-first-token, on the CPU with the tiny model.

    python scripts/bench_proxy_overhead.py [--requests 200]

Starts one generator and a proxy in front of it. Alternates, request by
request: (a) a streaming chat completion through the proxy's HTTP API, timed
from sending the request to receiving the first content chunk, once with
httpx and once from a bare socket (no client-side HTTP parsing); (b) the same
prompt, already tokenized, sent straight to the generator as a
GenerateRequest over ZeroMQ, timed to the first TokenDelta with text. The difference of
the medians is the proxy's added latency (HTTP, JSON, chat template,
tokenization, one more ZeroMQ hop, SSE).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
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


FIRST_TOKEN = re.compile(rb'"delta":\{"content":"[^"]')


def through_proxy_raw(conn: socket.socket, port: int, text: str) -> float:
    """The same request from a bare socket: the clock stops at the bytes of
    the first token, with no client-side HTTP parsing (httpx's pure-Python
    parser costs a few hundred microseconds that are the client's, not the
    proxy's)."""
    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": 2,
                       "temperature": 0, "stream": True, "ignore_eos": True}).encode()
    request = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    start = time.perf_counter()
    conn.sendall(request)
    received, first = b"", None
    while not received.endswith(b"\r\n0\r\n\r\n"):   # the end of a chunked body
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionError("the proxy closed the connection")
        received += chunk
        if first is None and FIRST_TOKEN.search(received):
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
    # One torch thread per stage: on a 2-core machine running the client and
    # two stages, idle OpenMP workers sleep between requests and waking
    # them costs milliseconds, more on whichever path leaves them idle longer.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    stack = Stack(run, model_dir, encoders=0, generators=1, aggregated=True)
    ctx = zmq.Context()
    me = f"ipc://{run}/bench.sock"
    inbox = transport.make_socket(ctx, zmq.PULL, me, bind=True)
    out = transport.make_socket(ctx, zmq.PUSH, f"ipc://{run}/gen0.sock", bind=False)
    try:
        stack.wait_healthy()
        client = httpx.Client(timeout=60)
        conn = socket.create_connection(("127.0.0.1", stack.port))
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        times: dict[str, list[float]] = {"httpx": [], "socket": [], "direct": []}
        for i in range(args.requests + 20):
            text = f"Request number {i}: say something."
            ids = processor.chat_prompt([{"role": "user", "content": text}], []).token_ids
            sample = {"httpx": through_proxy(client, stack.base_url, text),
                      "socket": through_proxy_raw(conn, stack.port, text),
                      "direct": direct(out, inbox, me, ids, f"direct-{i}")}
            if i >= 20:  # warm-up
                for key, seconds in sample.items():
                    times[key].append(seconds * 1000)
        conn.close()
        p50 = {key: statistics.median(values) for key, values in times.items()}
        p99 = {key: sorted(values)[int(0.99 * len(values)) - 1] for key, values in times.items()}
        print(f"TTFT through the proxy, httpx client: p50 {p50['httpx']:.3f} ms, p99 {p99['httpx']:.3f} ms")
        print(f"TTFT through the proxy, socket client: p50 {p50['socket']:.3f} ms, p99 {p99['socket']:.3f} ms")
        print(f"TTFT straight to the generator: p50 {p50['direct']:.3f} ms, p99 {p99['direct']:.3f} ms")
        print(f"proxy added latency (p50 difference): {p50['socket'] - p50['direct']:.3f} ms with a socket "
              f"client, {p50['httpx'] - p50['direct']:.3f} ms with httpx, over {len(times['direct'])} requests")
    finally:
        inbox.close()
        out.close()
        ctx.term()
        stack.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
