"""epd-bench's runner against a synthetic server that falls behind or hangs:
a fixed-rate run reports it and waits; a search step's stop rule cancels
what it left running, and the server sees each stream close."""

from __future__ import annotations

import asyncio

from bench_fakes import Hang, fake_server, serve, small_dataset, sweep_against_fake
from pipeline.bench.client import bench_runner
from pipeline.bench.stop import DRAIN_TIMEOUT, FELL_BEHIND, StopRule
from pipeline.bench.window import WindowSpec


def test_fixed_rate_run_that_falls_behind_reports_it_and_waits_for_all():
    # 12 requests at 100 req/s to a server doing one at a time (~0.1 s each).
    (r,), _ = asyncio.run(sweep_against_fake(small_dataset(num_prompts=12), [100.0], {}, max_concurrency=None,
                                             serial=True))
    assert r["completed"] == 12 and r["failed"] == 0 and r["cancelled"] == 0
    assert r["offered_rate"] > 30 and r["sustained_ratio"] < 0.5 and r["sustained"] is False
    assert r["window_s"]["start"] == 0.0 and r["window_s"]["shift"] > 0.1


async def measure_with_stop(hang: Hang, num_prompts: int, spec: WindowSpec, rule: StopRule) -> dict:
    runner, base_url = await serve(fake_server([], hang=hang))
    try:
        async with bench_runner(base_url, None, small_dataset(num_prompts=num_prompts), 1.0, None, 3,
                                {"ttft": 1000}, False, window=spec, stop=rule) as bench:
            result = await bench.measure(200.0, 0)
        # The server saw every cancelled stream close (a deadline, not a sleep).
        await asyncio.wait_for(hang.all_aborted.wait(), 10)
    finally:
        await runner.cleanup()
    return result


def test_a_step_that_fell_behind_cancels_what_it_left_running():
    hang = Hang(first=4, count=8)  # 4 of 12 complete: the step can never reach 0.95
    # A short grace (the default is 2 s) that still lets the 4 fast ones end first.
    rule = StopRule(drain_timeout_s=30.0, min_grace_s=0.5)
    r = asyncio.run(measure_with_stop(hang, 12, WindowSpec(0.0, 0.95), rule))
    assert r["completed"] == 4 and r["failed"] == 8 and r["cancelled"] == 8
    assert r["errors"] == [FELL_BEHIND] * 8
    assert sorted(hang.aborted) == list(range(4, 12))
    assert r["sustained"] is False and r["sustained_ratio"] < 0.34  # at most 4 of 12 completed
    assert r["duration"] < rule.drain_timeout_s  # stopped at its verdict, not at the drain timeout


def test_a_sustained_step_cancels_its_stragglers_at_the_drain_timeout():
    hang = Hang(first=11, count=1)
    # The sustained check off: only the drain timeout can stop the step.
    r = asyncio.run(measure_with_stop(hang, 12, WindowSpec(0.0, 0.0), StopRule(drain_timeout_s=1.0)))
    assert r["completed"] == 11 and r["cancelled"] == 1 and r["errors"] == [DRAIN_TIMEOUT]
    assert hang.aborted == [11]
