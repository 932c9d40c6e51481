#!/usr/bin/env python3
"""GPU arena handoff: correctness and latency, against PyTorch's per-tensor IPC.

Run on the GPU box (not in CI):
    python scripts/gpu_arena_bench.py --consumer-device 0      # same GPU
    python scripts/gpu_arena_bench.py --consumer-device 1      # other GPU (peer copy)

A producer process holds a CUDA arena on cuda:0 (ArenaStore, exported once);
a consumer process opens it once (ArenaReader) and, per handoff, receives an
EmbeddingReady and copies the embedding into its own memory, as a generator
does: the message comes through the consumer's shared-memory ring when the
encoder's RingLanes takes it (`--lane ring`, the default on one host) or over
ZeroMQ (`--lane zmq`); leases go back over ZeroMQ.

Handoff = message + read: from the producer sending the handle (its write
into the arena done) to the consumer holding a synchronised, checked private
copy. Total adds the producer's store (reserve, write, synchronise, lease).
The per-tensor baseline sends each tensor through a torch.multiprocessing
queue (PyTorch's CUDA IPC): its handoff runs from the put (after clone and
synchronise) to the consumer's synchronised copy, its total from before the
clone. Both paths run in this one invocation; the printed ratios compare them.
The arena path's sizes take turns, after `--warmup` untimed handoffs each;
the per-tensor path drops its first 10%.
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

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import zmq  # noqa: E402

from bench_procs import result_or_raise  # noqa: E402
from pipeline import protocol  # noqa: E402

WIDTH = 2048  # a 3B-class hidden size; bf16 rows of 4 KiB


def rows_for(mib: int) -> int:
    return (mib << 20) // (WIDTH * 2)


def seeded(seed: int, rows: int, device: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, WIDTH, generator=gen).to(torch.bfloat16).to(device)


def percentiles(samples_ns: list[int]) -> dict[str, float]:
    us = sorted(s / 1000 for s in samples_ns)
    return {"p50_us": statistics.median(us), "p99_us": us[min(len(us) - 1, int(0.99 * len(us)))],
            "n": len(us)}


# ------------------------------------------------------------- arena path

def producer(address: str, consumer: str, sizes: list[int], iters: int, checks: int, warmup: int) -> None:
    from pipeline.arena.store import ArenaStore
    from pipeline.encoder.ring_lanes import RingLanes

    torch.cuda.set_device(0)
    store = ArenaStore(512 << 20, 64 << 10, torch.device("cuda:0"), f"bench-{os.getpid()}", 60.0)
    ctx = zmq.Context()
    inbox, out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.bind(address)
    out.connect(consumer)
    lanes = RingLanes(lambda _, message: out.send(protocol.encode(message)) or True, "bench")
    lanes.on_hello(protocol.decode(inbox.recv()))     # the consumer's Hello: its ring, if any
    out.send(protocol.encode(protocol.EncoderAnnounce("bench", address, "bench", store.info, {"image": WIDTH})))
    try:
        sources = {mib: [seeded(seed, rows_for(mib), "cuda:0") for seed in range(checks)] for mib in sizes}
        # Checked handoffs, then untimed warm-up ones, then timed ones; the
        # sizes take turns, so no size gets a colder host or GPU than another.
        for i in range(checks + warmup + iters):
            phase = "check" if i < checks else "warm" if i < checks + warmup else "timed"
            for mib in sizes:
                rows = rows_for(mib)
                src = sources[mib][i if i < checks else 0]
                t0 = time.perf_counter_ns()
                entry = store.reserve(f"{mib}-{i}", (rows, WIDTH), torch.bfloat16)
                store.write(entry, src)
                store.sync()
                store.index.mark_ready(entry.content_hash)
                lease = store.index.lease(entry.content_hash, consumer, "r")
                t_stored = time.perf_counter_ns()
                ready = protocol.EmbeddingReady(f"{mib}:{i}:{t0}:{t_stored}:{phase}", "r", entry.content_hash,
                                                store.handle(entry), lease.lease_id, "bench")
                if not lanes.deliver(consumer, ready):    # what the encoder does
                    out.send(protocol.encode(ready))
                release = protocol.decode(inbox.recv())
                store.index.release(release.lease_ids[0])
                store.index.evict(entry.content_hash)  # keep the arena from filling
        out.send(protocol.encode(protocol.Heartbeat("done", 0.0)))
    finally:
        lanes.close()
        inbox.close()
        out.close()
        ctx.term()
        store.close()


class ReadyInbox:
    """The next message from the ring or the socket, as the generator's loop
    takes them: spinning (a busy generator) or, blocking, with the ring's
    sleep flag raised so the producer sends a wake-up."""

    def __init__(self, socket, ring_in, spin: bool) -> None:
        self.socket, self.ring, self.spin = socket, ring_in, spin
        self.waiting: list[bytes] = []
        self.spins = 0

    def recv(self):
        while True:
            if self.ring is not None and not self.waiting:
                self.waiting.extend(self.ring.pop())
            if self.waiting:
                return protocol.decode(self.waiting.pop(0))
            message = self._from_socket()
            if message is not None and not isinstance(message, protocol.Wake):
                return message

    def _from_socket(self):
        if self.spin:
            # A generator's engine thread never touches its socket (a receiver
            # thread does); here, with a ring, look at the socket only now and
            # then, for the control messages.
            self.spins += 1
            if self.ring is not None and self.spins % 256:
                return None
            try:
                return protocol.decode(self.socket.recv(zmq.NOBLOCK))
            except zmq.Again:
                return None
        if self.ring is not None and not self.ring.may_sleep():
            return None
        message = protocol.decode(self.socket.recv())
        if self.ring is not None:
            self.ring.awake()
        return message


def summarise(samples: dict[str, list[int]], result: dict) -> None:
    for key, s in samples.items():
        mib, part = key.split("/")
        stats = percentiles(s)   # warmed up already (--warmup)
        if part in ("total", "handoff"):
            result["sizes"].setdefault(mib, {})[part] = stats
        else:
            result.setdefault("parts", {}).setdefault(mib, {})[part] = stats["p50_us"]


def consumer(address: str, producer_address: str, device: str, checks: int, spin: bool,
             peer_context: bool, lane: str) -> dict:
    from pipeline.arena import ring
    from pipeline.arena.reader import ArenaReader

    torch.cuda.set_device(torch.device(device))
    ctx = zmq.Context()
    inbox, out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.bind(address)
    out.connect(producer_address)
    reader = ArenaReader(None if peer_context else torch.device(device))
    rings = ring.create_inbound(f"bench-consumer-{os.getpid()}", [producer_address]) if lane == "ring" else {}
    mine = rings.get(producer_address)
    out.send(protocol.encode(protocol.Hello("consumer", address, mine.segment.name if mine else "",
                                            ring.host_id() if mine else "")))
    recv = ReadyInbox(inbox, mine, spin).recv

    announce = recv()
    t = time.perf_counter_ns()
    reader.open(announce.arena)
    # The consumer's own memory, as a generator's encoder cache would hold it.
    buffers: dict[tuple, torch.Tensor] = {}
    result = {"open_ms": (time.perf_counter_ns() - t) / 1e6, "sizes": {}, "mismatches": 0}
    samples: dict[str, list[int]] = {}
    while True:
        message = recv()
        if isinstance(message, protocol.Heartbeat):
            break
        t_recv = time.perf_counter_ns()
        shape = tuple(message.handle.shape)
        if shape not in buffers:
            buffers[shape] = torch.empty(shape, dtype=torch.bfloat16, device=device)
        pending = reader.read_async(message.handle, out=buffers[shape])   # what read() does, timed in parts
        t_queued = time.perf_counter_ns()
        while not pending.done():      # a generator polls its copies between steps
            pass
        t_copied = time.perf_counter_ns()
        reader.verify(message.handle)
        got = pending.tensor
        t1 = time.perf_counter_ns()
        out.send(protocol.encode(protocol.ReleaseLease((message.lease_id,), "consumer")))
        mib, i, t0, t_stored, phase = message.job_id.split(":")
        if phase == "check":
            if not torch.equal(got, seeded(int(i), got.shape[0], device)):
                result["mismatches"] += 1
        elif phase == "timed":
            t0, t_stored = int(t0), int(t_stored)
            for part, value in (("total", t1 - t0), ("handoff", t1 - t_stored), ("store", t_stored - t0),
                                ("message", t_recv - t_stored), ("read", t1 - t_recv),
                                ("read:queue", t_queued - t_recv), ("read:wait", t_copied - t_queued),
                                ("read:verify", t1 - t_copied)):
                samples.setdefault(f"{mib}/{part}", []).append(value)
    summarise(samples, result)
    reader.close()
    for lane_ring in rings.values():
        result["ring_messages"] = lane_ring.written
        lane_ring.close()
    inbox.close()
    out.close()
    ctx.term()
    return result


# ------------------------------------------------- PyTorch per-tensor IPC

def torch_ipc_producer(queue, acks, sizes: list[int], iters: int) -> None:
    torch.cuda.set_device(0)
    for mib in sizes:
        source = seeded(0, rows_for(mib), "cuda:0")
        for _ in range(iters):
            t0 = time.perf_counter_ns()
            tensor = source.clone()      # a new tensor per handoff, as a real producer makes
            torch.cuda.current_stream().synchronize()
            queue.put((mib, t0, time.perf_counter_ns(), tensor))
            acks.get()                   # keep it alive until the consumer has copied it
            del tensor
    queue.put(None)


def torch_ipc_consumer(queue, acks, device: str, results) -> None:
    torch.cuda.set_device(torch.device(device))
    samples: dict[tuple[int, str], list[int]] = {}
    while (item := queue.get()) is not None:
        mib, t0, t_put, tensor = item
        out = torch.empty_like(tensor, device=device)
        out.copy_(tensor, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        t1 = time.perf_counter_ns()
        samples.setdefault((mib, "total"), []).append(t1 - t0)
        samples.setdefault((mib, "handoff"), []).append(t1 - t_put)
        del tensor
        acks.put(1)
    out: dict = {}
    for (mib, part), s in samples.items():
        out.setdefault(str(mib), {})[part] = percentiles(s[len(s) // 10:])
    results.put(out)


def run_torch_ipc(sizes: list[int], iters: int, device: str) -> dict:
    ctx = mp.get_context("spawn")
    queue, acks, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=torch_ipc_producer, args=(queue, acks, sizes, iters)),
             ctx.Process(target=torch_ipc_consumer, args=(queue, acks, device, results))]
    for p in procs:
        p.start()
    out = result_or_raise(results, procs)
    for p in procs:
        p.join(timeout=60)
    return out


# ------------------------------------------------------------------- main

def run_arena(sizes: list[int], iters: int, device: str, checks: int, spin: bool, peer_context: bool,
              lane: str, warmup: int) -> dict:
    run_dir = Path(f"/tmp/epd-bench-{os.getpid()}")
    run_dir.mkdir(exist_ok=True)
    p_addr, c_addr = f"ipc://{run_dir}/p.sock", f"ipc://{run_dir}/c.sock"
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    cons = ctx.Process(target=_consumer_entry,
                       args=(c_addr, p_addr, device, checks, spin, peer_context, lane, results))
    cons.start()
    time.sleep(1.0)  # the consumer binds first
    prod = ctx.Process(target=producer, args=(p_addr, c_addr, sizes, iters, checks, warmup))
    prod.start()
    out = result_or_raise(results, [prod, cons])
    prod.join(timeout=60)
    cons.join(timeout=60)
    if prod.exitcode != 0:
        raise RuntimeError(f"producer exited with {prod.exitcode}")
    return out


def _consumer_entry(c_addr, p_addr, device, checks, spin, peer_context, lane, results):
    results.put(consumer(c_addr, p_addr, device, checks, spin, peer_context, lane))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--consumer-device", type=int, default=0)
    parser.add_argument("--sizes-mib", default="2,8")
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--checks", type=int, default=16, help="handoffs checked for equality per size")
    parser.add_argument("--warmup", type=int, default=200, help="untimed handoffs per size before the timed ones")
    parser.add_argument("--spin", action="store_true",
                        help="consumer busy-polls (a busy generator); default: it blocks on its socket when idle")
    parser.add_argument("--lane", choices=("ring", "zmq"), default="ring",
                        help="how EmbeddingReady travels: the consumer's shared-memory ring, or ZeroMQ only")
    parser.add_argument("--map-on-producer-gpu", action="store_true",
                        help="open the arena in a context on the producer's GPU (the old way), for comparison")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes_mib.split(",")]
    device = f"cuda:{args.consumer_device}"
    arena = run_arena(sizes, args.iters, device, args.checks, args.spin, args.map_on_producer_gpu, args.lane,
                      args.warmup)
    baseline = run_torch_ipc(sizes, max(200, args.iters // 4), device)
    report = {"device": torch.cuda.get_device_name(0), "consumer": device, "spin": args.spin, "lane": args.lane,
              "mapped_on_producer_gpu": args.map_on_producer_gpu, "arena": arena, "torch_ipc": baseline}
    print(f"producer cuda:0 -> consumer {device}, lane {args.lane}, {'spinning' if args.spin else 'blocking'} "
          f"consumer; arena opened once in {arena['open_ms']:.1f} ms; ring messages "
          f"{arena.get('ring_messages', 0)}; equality mismatches: {arena['mismatches']}")
    for mib, parts in arena.get("parts", {}).items():
        print(f"{mib}MiB arena p50 parts (us): " + ", ".join(f"{k} {v:.1f}" for k, v in parts.items()))
    print(f"{'size':>6} {'what':>8} {'arena p50':>10} {'arena p99':>10} {'torch p50':>10} {'torch p99':>10} "
          f"{'p50 ratio':>9}")
    for mib in map(str, sizes):
        for part in ("handoff", "total"):
            a, b = arena["sizes"][mib][part], baseline[mib][part]
            print(f"{mib + 'MiB':>6} {part:>8} {a['p50_us']:>9.1f}u {a['p99_us']:>9.1f}u {b['p50_us']:>9.1f}u "
                  f"{b['p99_us']:>9.1f}u {b['p50_us'] / a['p50_us']:>8.1f}x")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 1 if arena["mismatches"] else 0


if __name__ == "__main__":
    sys.exit(main())
