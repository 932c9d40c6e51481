#!/usr/bin/env python3
"""Where a handoff's time goes: message lanes and copy variants, side by side.

Run on the GPU box (not in CI):
    python scripts/gpu_handoff_micro.py --consumer-device 1

A producer process holds a CUDA arena on cuda:0 with one 2 MiB and one
8 MiB embedding written once; per handoff it stamps the time and sends the
handle, over the shared-memory ring or ZeroMQ. The consumer (busy-polling)
copies the embedding into its own buffer by one of several variants (the
reader's read_async, a plain Tensor.copy_, a captured gather), chosen
round-robin so all are measured in the same minutes, waits for the copy by
spinning on an event, checks equality on the first handoffs, and acks.
Printed: p50/p99 of message (send stamp to decoded), copy (decoded to copy
complete) and their sum, per lane, variant and size.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import msgspec  # noqa: E402
import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import zmq  # noqa: E402

from bench_procs import result_or_raise  # noqa: E402
from pipeline import protocol  # noqa: E402
from pipeline.arena import ring  # noqa: E402

WIDTH = 2048
SIZES = (2, 8)
VARIANTS = ("read_async", "copy_", "graph", "steps")
STEPS = ("verify_before", "checks", "slot", "descriptor", "launch", "wait", "verify_after")


def rows_for(mib: int) -> int:
    return (mib << 20) // (WIDTH * 2)


def seeded(mib: int, device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(mib)
    return torch.randn(rows_for(mib), WIDTH, generator=gen).to(torch.bfloat16).to(device)


class Lane:
    """Producer->consumer messages and consumer->producer acks, over rings or zmq."""

    def __init__(self, kind: str, run_dir: Path, side: str) -> None:
        self.kind = kind
        names = {"down": f"epd-bench.{os.getppid()}-1-down", "up": f"epd-bench.{os.getppid()}-1-up"}
        self._ctx = None
        if kind == "ring":
            mine, theirs = (names["down"], names["up"]) if side == "consumer" else (names["up"], names["down"])
            self.inbox = ring.create(mine, 64, 1024)
            deadline = time.time() + 30
            while True:
                try:
                    self.outbox = ring.attach(theirs, stale_s=30)
                    break
                except FileNotFoundError:
                    if time.time() > deadline:
                        raise
                    time.sleep(0.01)
        else:
            self._ctx = zmq.Context()
            self.inbox, self.outbox = self._ctx.socket(zmq.PULL), self._ctx.socket(zmq.PUSH)
            mine, theirs = ("c", "p") if side == "consumer" else ("p", "c")
            self.inbox.bind(f"ipc://{run_dir}/{mine}.sock")
            self.outbox.connect(f"ipc://{run_dir}/{theirs}.sock")

    def send(self, data: bytes) -> None:
        if self.kind == "ring":
            while not self.outbox.push(data):
                pass
        else:
            self.outbox.send(data)

    def recv(self) -> bytes:
        if self.kind == "ring":
            while True:
                got = self.inbox.pop()
                if got:
                    assert len(got) == 1, "ping-pong: one message at a time"
                    return got[0]
        while True:
            try:
                return self.inbox.recv(zmq.NOBLOCK)
            except zmq.Again:
                pass

    def close(self) -> None:
        if self.kind == "ring":
            self.inbox.close()
            self.outbox.close()
        else:
            self.inbox.close(linger=0)
            self.outbox.close(linger=0)
            self._ctx.term()


def producer(lane_kind: str, run_dir: str, iters: int, infos) -> None:
    from pipeline.arena.store import ArenaStore

    torch.cuda.set_device(0)
    store = ArenaStore(64 << 20, 64 << 10, torch.device("cuda:0"), f"bench-{os.getpid()}", 600.0)
    handles = {}
    for mib in SIZES:
        entry = store.reserve(f"e{mib}", (rows_for(mib), WIDTH), torch.bfloat16)
        store.write(entry, seeded(mib, "cuda:0"))
        handles[mib] = store.handle(entry)
    store.sync()
    infos.put(msgspec.msgpack.encode(store.info))  # out of band: only handoffs are timed on the lane
    lane = Lane(lane_kind, Path(run_dir), "producer")
    try:
        lane.recv()  # consumer opened the arena
        for i in range(iters * len(SIZES) * len(VARIANTS)):
            mib = SIZES[i % len(SIZES)]
            ready = protocol.EmbeddingReady(f"{time.perf_counter_ns()}", "r", f"e{mib}", handles[mib], "l", "b")
            lane.send(protocol.encode(ready))
            lane.recv()
        lane.send(protocol.encode(protocol.Heartbeat("done", 0.0)))
    finally:
        lane.close()
        store.close()


def consumer(lane_kind: str, run_dir: str, device: str, arena_info: bytes, iters: int, results) -> None:
    from pipeline.arena.reader import ArenaReader

    torch.cuda.set_device(torch.device(device))
    reader = ArenaReader(torch.device(device))
    info = msgspec.msgpack.decode(arena_info, type=protocol.ArenaInfo)
    reader.open(info)
    lane = Lane(lane_kind, Path(run_dir), "consumer")
    arena = reader._arenas[info.arena_id]
    expected = {mib: seeded(mib, device) for mib in SIZES}
    outs = {mib: torch.empty_like(expected[mib]) for mib in SIZES}
    event, stream = torch.cuda.Event(), torch.cuda.current_stream()
    graphs = _capture_graphs(arena.data, arena.info.block_bytes, outs)
    lane.send(b"open")
    samples: dict[str, list[int]] = {}
    mismatches = 0
    n = 0
    while True:
        message = protocol.decode(lane.recv())
        t_recv = time.perf_counter_ns()
        if isinstance(message, protocol.Heartbeat):
            break
        handle = message.handle
        mib = handle.nbytes >> 20
        variant = VARIANTS[(n // len(SIZES)) % len(VARIANTS)]
        out = outs[mib]
        if n < 24:   # checked handoffs: clear the buffer first, outside the timing
            out.zero_()
            stream.synchronize()
            t_recv = time.perf_counter_ns()
        copy_out(variant, reader, arena, handle, out, graphs[mib], samples, event, stream)
        t_done = time.perf_counter_ns()
        lane.send(b"ack")
        if n < 24:
            mismatches += int(not torch.equal(out, expected[mib]))
        t_sent = int(message.job_id)
        key = f"{variant}/{mib}MiB"
        samples.setdefault(f"{key}/message", []).append(t_recv - t_sent)
        samples.setdefault(f"{key}/copy", []).append(t_done - t_recv)
        samples.setdefault(f"{key}/total", []).append(t_done - t_sent)
        n += 1
    lane.close()
    reader.close()
    out = {"mismatches": mismatches}
    for key, s in samples.items():
        us = sorted(x / 1000 for x in s[len(s) // 10:])
        out[key] = {"p50": statistics.median(us), "p99": us[min(len(us) - 1, int(0.99 * len(us)))]}
    results.put(out)


def copy_out(variant: str, reader, arena, handle, out: torch.Tensor, graph_entry, samples: dict,
             event: torch.cuda.Event, stream: torch.cuda.Stream) -> None:
    """One handoff's copy by `variant`, waited for by spinning on an event
    (the plain variants reuse one), then the generation check."""
    if variant == "read_async":
        pending = reader.read_async(handle, out=out)
        while not pending.done():
            pass
        reader.verify(handle)
    elif variant == "copy_":
        source = arena.data[handle.offset:handle.offset + handle.nbytes]
        out.view(-1).view(torch.uint8).copy_(source, non_blocking=True)
        event.record(stream)
        while not event.query():
            pass
        reader.verify(handle)
    elif variant == "steps":     # read_async's copier path inline, each step timed
        copy_in_steps(reader, arena, handle, out, samples)
    else:
        start, graph, _ = graph_entry
        start[0] = handle.offset // arena.info.block_bytes
        graph.replay()
        event.record(stream)
        while not event.query():
            pass
        reader.verify(handle)


def copy_in_steps(reader, arena, handle, out: torch.Tensor, samples: dict) -> None:
    mib = handle.nbytes >> 20
    marks = [time.perf_counter_ns()]
    reader.verify(handle)
    marks.append(time.perf_counter_ns())
    copier = arena.copier
    assert out.get_device() == copier.index and copier.accepts(handle.nbytes, out)
    assert torch.cuda.current_device() == copier.index
    marks.append(time.perf_counter_ns())
    slot = copier.take_row()
    marks.append(time.perf_counter_ns())
    copier.describe(slot, arena.base + handle.offset, out.data_ptr(), handle.nbytes)
    marks.append(time.perf_counter_ns())
    slot_event = copier.launch(slot)     # the replay (the graph records the event)
    marks.append(time.perf_counter_ns())
    while not slot_event.query():
        pass
    marks.append(time.perf_counter_ns())
    reader.verify(handle)
    marks.append(time.perf_counter_ns())
    for name, a, b in zip(STEPS, marks, marks[1:]):
        samples.setdefault(f"steps/{mib}MiB/step:{name}", []).append(b - a)


def _capture_graphs(data: torch.Tensor, block_bytes: int, outs: dict) -> dict:
    """Per size: a graph that gathers the run of blocks starting at the block
    number written into a pinned host cell (read by the graph at replay)."""
    blocks = data.view(torch.int64).view(-1, block_bytes // 8)
    graphs = {}
    for mib, out in outs.items():
        count = (mib << 20) // block_bytes
        start = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        start_dev = torch.zeros(1, dtype=torch.int64, device=out.device)
        steps = torch.arange(count, device=out.device)
        target = out.view(torch.int64).view(count, -1)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                start_dev.copy_(start, non_blocking=True)
                torch.index_select(blocks, 0, steps + start_dev, out=target)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            start_dev.copy_(start, non_blocking=True)
            torch.index_select(blocks, 0, steps + start_dev, out=target)
        # The graph reads these at replay: they must outlive it.
        graphs[mib] = (start.numpy(), graph, (start, start_dev, steps))
    return graphs


def run(lane_kind: str, device: str, iters: int) -> dict:
    run_dir = Path(f"/tmp/epd-micro-{os.getpid()}")
    run_dir.mkdir(exist_ok=True)
    ctx = mp.get_context("spawn")
    results, infos = ctx.Queue(), ctx.Queue()
    prod = ctx.Process(target=producer, args=(lane_kind, str(run_dir), iters, infos))
    prod.start()
    info = result_or_raise(infos, [prod])
    cons = ctx.Process(target=consumer, args=(lane_kind, str(run_dir), device, info, iters, results))
    cons.start()
    out = result_or_raise(results, [prod, cons])
    prod.join(timeout=60)
    cons.join(timeout=60)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--consumer-device", type=int, default=1)
    parser.add_argument("--iters", type=int, default=400, help="handoffs per size and variant")
    parser.add_argument("--lanes", default="ring,zmq")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = f"cuda:{args.consumer_device}"
    report = {"consumer": device, "ring_supported": ring.supported()}
    bad = 0
    for lane in args.lanes.split(","):
        result = run(lane, device, args.iters)
        report[lane] = result
        bad += result["mismatches"]
        print(f"lane {lane}, producer cuda:0 -> consumer {device}: mismatches {result['mismatches']}")
        for variant in VARIANTS:
            for mib in SIZES:
                key = f"{variant}/{mib}MiB"
                parts = " ".join(f"{p} {result[f'{key}/{p}']['p50']:6.1f}/{result[f'{key}/{p}']['p99']:6.1f}"
                                 for p in ("message", "copy", "total"))
                print(f"  {key:<20} p50/p99 us: {parts}")
        for mib in SIZES:
            print(f"  steps/{mib}MiB p50 us: " + ", ".join(
                f"{step} {result[f'steps/{mib}MiB/step:{step}']['p50']:.1f}" for step in STEPS))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
