"""The soak (issue 19): the users' topology on the built-in tiny model on
the CPU, under a mixed open-loop load for a given time, with faults at
seeded random moments (an encoder or a generator SIGKILLed, a generator
SIGSTOPped and continued, the proxy restarted). Reports what became of
every request, each stage's RSS over time, arena leases and KV blocks at
idle, and what was left in /dev/shm and the process table after the stop.
Exits 0 only when every acceptance condition holds (docs/reliability.md).

    python3 scripts/soak.py --minutes 10 --json /tmp/soak10.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import aiohttp  # noqa: E402
import numpy as np  # noqa: E402

from pipeline.arena.shm import our_segments  # noqa: E402
from pipeline.bench.client import fetch_default_model  # noqa: E402
from pipeline.bench.launched import LaunchedStack, StackError, free_port  # noqa: E402
from pipeline.transport import private_run_dir  # noqa: E402
from soak_faults import ROOM_S, FaultPlan  # noqa: E402
from soak_load import plan_load, run_load  # noqa: E402
from soak_report import (classify, conditions, failures, request_figures, rss_verdicts, summary,  # noqa: E402
                         unexpected_restarts)
from soak_stack import IDLE_GAUGES, MARK_VAR, Stages, leftovers, parse_metrics, stop_launcher  # noqa: E402

IDLE_WITHIN_S = 60.0     # for the gauges to reach 0 once the load is over


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="soak.py", description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=10.0, help="how long the load runs")
    p.add_argument("--seed", type=int, default=0, help="the load's and the faults' random draws")
    p.add_argument("--rate", type=float, default=3.0, help="requests a second (Poisson arrivals)")
    p.add_argument("--encoders", type=int, default=2)
    p.add_argument("--generators", type=int, default=2)
    p.add_argument("--warmup-s", type=float, default=30.0,
                   help="seconds of load before the faults begin and the RSS baselines are taken")
    p.add_argument("--fault-gap-s", type=float, nargs=2, default=(10.0, 30.0), metavar=("MIN", "MAX"),
                   help="seconds between one fault's recovery and the next fault (drawn)")
    p.add_argument("--rss-interval-s", type=float, default=3.0, help="seconds between RSS samples")
    p.add_argument("--rss-tolerance", type=float, default=0.10, help="allowed |end / baseline - 1| of each RSS")
    p.add_argument("--request-timeout-s", type=float, default=180.0, help="a request's client-side limit")
    p.add_argument("--log-dir", type=Path, help="the stages' logs (default: a fresh temporary folder)")
    p.add_argument("--port", type=int, help="the proxy's port (default: a free one)")
    p.add_argument("--json", type=Path, metavar="FILE", help="write the whole report here")
    args = p.parse_args(argv)
    for name in ("minutes", "rate", "rss_interval_s", "request_timeout_s"):
        if not getattr(args, name) > 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    if args.encoders < 1 or args.generators < 1:
        p.error("--encoders and --generators must be at least 1")
    if not 0 <= args.fault_gap_s[0] <= args.fault_gap_s[1]:
        p.error("--fault-gap-s needs 0 <= MIN <= MAX")
    if args.warmup_s < 0 or not 0 < args.rss_tolerance < 1:
        p.error("--warmup-s must be >= 0 and --rss-tolerance in (0, 1)")
    return args


async def sample_rss(stages: Stages, interval_s: float) -> None:
    while True:
        stages.sample_rss()
        await asyncio.sleep(interval_s)


async def probe_health(base_url: str, t0: float, seen: list) -> None:
    """GET /health every second: the answers' status and latency, to tell a
    stalled proxy (slow answers) from stages it sees down (503s)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        while True:
            sent = time.monotonic()
            try:
                async with session.get(base_url + "/health") as resp:
                    status = resp.status
            except (aiohttp.ClientError, asyncio.TimeoutError):
                status = None
            seen.append((round(sent - t0, 2), status, round(time.monotonic() - sent, 3)))
            await asyncio.sleep(1.0)


async def idle_gauges(base_url: str) -> dict:
    """The stage gauges once every one is 0 and every stage is up, or as
    they were at the deadline."""
    deadline = time.monotonic() + IDLE_WITHIN_S
    started = time.monotonic()
    seen: dict = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        while True:
            try:
                async with session.get(base_url + "/health") as health, session.get(base_url + "/metrics") as resp:
                    metrics = parse_metrics(await resp.text())
                    seen = {name: metrics.get(name) for name in IDLE_GAUGES}
                    seen["healthy"] = health.status == 200
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                seen = {"error": str(exc)}
            if (seen.get("healthy") and all(seen.get(n) == 0 for n in IDLE_GAUGES)) or time.monotonic() > deadline:
                seen["waited_s"] = round(time.monotonic() - started, 2)
                return seen
            await asyncio.sleep(0.5)


async def soak(args: argparse.Namespace, stack: LaunchedStack, stages: Stages, mark: str, t0: float) -> dict:
    """Load and faults until the time is up, then the idle reading."""
    rng = np.random.default_rng(args.seed)
    duration = args.minutes * 60
    planned = plan_load(np.random.default_rng(rng.integers(2 ** 63)), duration, args.rate)
    faults = FaultPlan(stages, stack.base_url, stack.log_dir / "proxy.log", mark,
                       np.random.default_rng(rng.integers(2 ** 63)), t0, tuple(args.fault_gap_s))
    probes: list = []
    sampler = asyncio.create_task(sample_rss(stages, args.rss_interval_s))
    prober = asyncio.create_task(probe_health(stack.base_url, t0, probes))
    try:
        async with aiohttp.ClientSession() as session:
            model = await fetch_default_model(session, stack.base_url)
        load_start = time.monotonic()
        print(f"soak: load of {len(planned)} requests over {duration:g} s on {stack.base_url}", flush=True)
        start_s = load_start - t0
        results, injected = await asyncio.gather(
            run_load(stack.base_url, model, planned, load_start, args.request_timeout_s),
            faults.run(start_s + args.warmup_s, start_s + duration - args.warmup_s - ROOM_S))
        for r in results:   # seconds after t0, like the faults and the samples
            r.sent_s += start_s
            r.ended_s += start_s
        idle = await idle_gauges(stack.base_url)
        stages.sample_rss()   # the end value: at idle
    finally:
        faults.resume_stopped()
        sampler.cancel()
        prober.cancel()
    return {"results": results, "faults": injected, "idle": idle, "ready_s": start_s, "health": probes,
            "warmup_end_s": start_s + args.warmup_s, "end_s": time.monotonic() - t0}


def health_figures(probes: list) -> dict:
    """The /health probes: how slow the proxy got, and the answers that were not 200."""
    latencies = sorted(latency for _, status, latency in probes if status is not None)
    return {"probes": len(probes), "max_latency_s": latencies[-1] if latencies else None,
            "p99_latency_s": latencies[int(0.99 * (len(latencies) - 1))] if latencies else None,
            "slow": [p for p in probes if p[2] > 1.0], "not_ok": [p for p in probes if p[1] != 200]}


def build_report(args, ran: dict, stages: Stages, stop: dict, log_dir: Path) -> dict:
    classes = classify(ran["results"], ran["faults"], ran["end_s"])
    live = {inc.pid for inc in stages.current.values()}
    first = {inc.pid for inc in stages.incarnations if inc.seen_s <= ran["ready_s"]}
    ready = {pid: ran["ready_s"] for pid in first} | {f.new_pid: f.recovered_s for f in ran["faults"] if f.new_pid}
    report = {"command": " ".join(["python3", "scripts/soak.py", *sys.argv[1:]]), "seed": args.seed,
              "minutes": args.minutes, "rate": args.rate, "encoders": args.encoders, "generators": args.generators,
              "warmup_s": args.warmup_s, "log_dir": str(log_dir),
              "requests": request_figures(ran["results"], classes),
              "failures": failures(ran["results"], classes, log_dir / "proxy.log"),
              "faults": [vars(f) for f in ran["faults"]], "idle": ran["idle"],
              "rss": rss_verdicts(stages.incarnations, ran["warmup_end_s"], args.warmup_s, ready, live,
                                  args.rss_tolerance),
              "unexpected_restarts": unexpected_restarts(stages.incarnations, first, ran["faults"]),
              "health": health_figures(ran["health"]), "stop": stop}
    report["conditions"] = {name: {"ok": ok, "seen": seen}
                            for name, (ok, seen) in conditions(report, args.rss_tolerance).items()}
    report["ok"] = all(c["ok"] for c in report["conditions"].values())
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    mark = f"{os.getpid()}-{os.urandom(4).hex()}"
    log_dir = (args.log_dir or Path(tempfile.mkdtemp(prefix="epd-soak-"))).resolve()
    port = args.port or free_port()
    shm_before = set(our_segments())
    stack = LaunchedStack(["--encoders", str(args.encoders), "--generators", str(args.generators), "--device", "cpu"],
                          log_dir, port=port, env={MARK_VAR: mark})
    t0 = time.monotonic()
    stages = Stages(log_dir / "launcher.log", t0)
    try:
        ready_s = stack.start(ready_timeout=180)
        print(f"soak: stack ready in {ready_s:.1f} s (logs: {log_dir})", flush=True)
        ran = asyncio.run(soak(args, stack, stages, mark, t0))
    except StackError as exc:
        print(f"soak: error: {exc}", file=sys.stderr)
        return 1
    finally:
        stop = stop_launcher(stack.proc, timeout_s=60) if stack.proc else {"exit_code": None, "killed": False}
    stop.update(leftovers(stages, mark, private_run_dir() / f"port-{port}"))
    stop["shm_left"] = sorted(set(stop["shm_left"]) - shm_before)
    report = build_report(args, ran, stages, stop, log_dir)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    print(summary(report), flush=True)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
