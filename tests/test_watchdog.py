"""The stages' hang watchdog (pipeline/watchdog.py): a loop that stops making
progress ends its process with every thread's stack in the log; one that
keeps going, or a watchdog turned off, never does. Each case runs in a
process of its own (the watchdog exits the process it is in)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipeline.encoder.periodic import watchdog_loop
from pipeline.watchdog import HangWatchdog

REPO = Path(__file__).resolve().parents[1]


def run_python(code: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def test_a_loop_that_stops_making_progress_exits_with_its_stack_in_the_log():
    done = run_python("""
        import time
        from pipeline.watchdog import HangWatchdog
        watchdog = HangWatchdog(1.0)

        def stuck_in_the_engine_loop():
            time.sleep(50)

        for _ in range(5):
            watchdog.progress()
            time.sleep(0.05)
        stuck_in_the_engine_loop()
        print("not reached")
    """)
    assert done.returncode == 1
    assert "Timeout" in done.stderr and "stuck_in_the_engine_loop" in done.stderr
    assert "not reached" not in done.stdout


def test_a_loop_that_keeps_going_or_a_watchdog_turned_off_never_trips():
    done = run_python("""
        import time
        from pipeline.watchdog import HangWatchdog
        watchdog, off = HangWatchdog(1.0), HangWatchdog(0)
        for _ in range(25):          # 2.5 s of turns, each far shorter than the timeout
            watchdog.progress()
            off.progress()
            time.sleep(0.1)
        watchdog.stop()
        time.sleep(1.5)              # stopped: no longer watched
        print("finished")
    """)
    assert done.returncode == 0 and "finished" in done.stdout and "Timeout" not in done.stderr
    with pytest.raises(ValueError, match=">= 0"):
        HangWatchdog(-1)


def test_a_generator_stage_whose_engine_loop_hangs_exits_for_its_launcher_to_restart(tiny_dir, tmp_path):
    """The real stage process, its loop made to hang on its 40th turn (about
    2 s in, idle turns wait 50 ms each): it exits with code 1 and the hung
    frame in its log, where it would otherwise answer stats forever."""
    done = run_python(f"""
        import sys, time
        from pipeline.generator.service import GeneratorService
        from stages import generator
        turns, run_once = [0], GeneratorService.run_once

        def hanging_run_once(self, *args, **kwargs):
            turns[0] += 1
            if turns[0] == 40:
                time.sleep(120)     # the engine thread stuck
            return run_once(self, *args, **kwargs)

        GeneratorService.run_once = hanging_run_once
        sys.exit(generator.main(["--model", {str(tiny_dir)!r}, "--device", "cpu", "--mode", "aggregated",
                                 "--address", "ipc://{tmp_path}/gen.sock", "--kv-cache-mib", "16",
                                 "--hang-timeout", "3"]))
    """, timeout=100)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "Timeout" in done.stderr and "hanging_run_once" in done.stderr


def test_the_encoder_re_arms_its_watchdog_only_while_no_forward_runs():
    class Counting(HangWatchdog):
        def __init__(self):
            super().__init__(None)
            self.calls = 0

        def progress(self, force: bool = False) -> None:
            self.calls += 1

    class Service:
        watchdog, forwarding = Counting(), True

    async def scenario():
        task = asyncio.create_task(watchdog_loop(Service))
        await asyncio.sleep(0.05)
        while_forwarding = Service.watchdog.calls
        Service.forwarding = False
        await asyncio.sleep(1.2)   # an off watchdog's rearm_s is 1 s: one more turn
        task.cancel()
        return while_forwarding, Service.watchdog.calls

    while_forwarding, after = asyncio.run(scenario())
    assert while_forwarding == 0 and after >= 1
