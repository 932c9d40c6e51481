"""The soak's faults: one at a time, at seeded random moments, each followed
by its recovery (the stage back, the proxy's /health 200) before the next.

- kill_encoder / kill_generator: SIGKILL one of the role's processes (not
  its first instance, where it has more: that one serves the whole run, so
  a leak has ten minutes to show); the launcher starts a new process;
- stop_generator / stop_encoder: SIGSTOP for a few seconds (drawn: either
  side of the proxy's 3 s down timeout), then SIGCONT: a stage that hangs
  and comes back;
- restart_proxy: SIGTERM; the proxy drains what it holds and exits, the
  launcher starts a new one, and the port refuses connections meanwhile.
"""

from __future__ import annotations

import asyncio
import itertools
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np

from soak_stack import Stages, signal_stage

KINDS = ("kill_encoder", "kill_generator", "stop_generator", "stop_encoder", "restart_proxy")
GENERATOR_KINDS = ("kill_generator", "stop_generator")
STOP_S = (2.0, 6.0)          # how long a stopped stage stays stopped
RECOVER_WITHIN_S = 90.0      # a fault the stack has not recovered from by then is a violation
# No fault starts later than the warm-up plus this before the load ends: the
# stage it restarts gets a warm-up of its own and an RSS series to judge.
ROOM_S = 10.0


@dataclass
class Fault:
    kind: str
    instance: str
    pid: int
    at_s: float                        # when the signal went, seconds after t0
    recovered_s: float | None = None   # when the stack was whole again (None: it was not)
    new_pid: int | None = None
    stopped_s: float | None = None     # stop_*: how long

    @property
    def touches_generator(self) -> bool:
        return self.kind in GENERATOR_KINDS


@dataclass
class FaultPlan:
    """Draws what the next fault is, and when; runs it and waits for the recovery."""

    stages: Stages
    base_url: str
    proxy_log: Path              # the proxy's log: it names each new incarnation it hears from
    mark: str                    # this run's EPD_SOAK_RUN value: only its processes get signals
    rng: np.random.Generator
    t0: float
    gap_s: tuple[float, float]
    faults: list[Fault] = field(default_factory=list)
    stopped: int | None = None   # a SIGSTOPped pid, to SIGCONT whatever happens

    def __post_init__(self) -> None:
        order = list(KINDS)
        self.rng.shuffle(order)
        self.kinds = itertools.cycle(order)   # each kind once per round, in a seeded order

    async def run(self, start_s: float, last_s: float) -> list[Fault]:
        """Faults from `start_s` (after a drawn gap); none starts after `last_s`."""
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            await self._sleep_until(start_s + self.rng.uniform(*self.gap_s))
            while self._now() <= last_s:
                injected = await self._inject(next(self.kinds))
                if injected is not None:
                    fault, heard = injected
                    self.faults.append(fault)
                    await self._recover(session, fault, heard)
                    if fault.recovered_s is None:
                        break           # the stack is not whole: no further faults
                await self._sleep_until(self._now() + self.rng.uniform(*self.gap_s))
        return self.faults

    def resume_stopped(self) -> None:
        if self.stopped is not None:
            signal_stage(self.stopped, signal.SIGCONT, self.mark)
            self.stopped = None

    async def _inject(self, kind: str) -> tuple[Fault, int] | None:
        role = "encoder" if kind.endswith("_encoder") else "proxy" if kind == "restart_proxy" else "generator"
        instances = self.stages.instances(role)
        if kind.startswith("kill_") and len(instances) > 1:
            instances = instances[1:]   # the first lives through the run: its RSS is the long series
        if not instances:
            return None
        instance = instances[int(self.rng.integers(len(instances)))]
        pid = self.stages.pid(instance)
        sig = {"kill_encoder": signal.SIGKILL, "kill_generator": signal.SIGKILL, "stop_generator": signal.SIGSTOP,
               "stop_encoder": signal.SIGSTOP, "restart_proxy": signal.SIGTERM}[kind]
        if pid is None or not signal_stage(pid, sig, self.mark):
            return None
        heard = self._restarts_heard(instance)
        fault = Fault(kind, instance, pid, round(self._now(), 2))
        print(f"soak: {fault.at_s:7.1f} s  {kind} {instance} (pid {pid})", flush=True)
        if kind.startswith("stop_"):
            self.stopped = pid
            fault.stopped_s = round(float(self.rng.uniform(*STOP_S)), 2)
            try:
                await asyncio.sleep(fault.stopped_s)
            finally:
                self.resume_stopped()
        return fault, heard

    async def _recover(self, session: aiohttp.ClientSession, fault: Fault, heard: int) -> None:
        """Wait for the stage's next process (after a kill or restart), for the
        proxy to have heard from it (a killed stage), and a 200 from /health.
        /health alone is not enough: a stage killed a moment ago still
        counts as up until the proxy's down timeout."""
        deadline = time.monotonic() + RECOVER_WITHIN_S
        restarted = not fault.kind.startswith("stop_")
        killed = fault.kind.startswith("kill_")
        while time.monotonic() < deadline:
            pid = self.stages.pid(fault.instance)
            if ((not restarted or pid != fault.pid) and (not killed or self._restarts_heard(fault.instance) > heard)
                    and await self._healthy(session)):
                fault.new_pid = pid if restarted else None
                fault.recovered_s = round(self._now(), 2)
                return
            await asyncio.sleep(0.2)

    def _restarts_heard(self, instance: str) -> int:
        """How often the proxy has logged a new incarnation of `instance`."""
        try:
            return self.proxy_log.read_text(errors="replace").count(f"/{instance}.sock restarted")
        except FileNotFoundError:
            return 0

    async def _healthy(self, session: aiohttp.ClientSession) -> bool:
        try:
            async with session.get(self.base_url + "/health") as resp:
                return resp.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    async def _sleep_until(self, at_s: float) -> None:
        await asyncio.sleep(max(0.0, at_s - self._now()))

    def _now(self) -> float:
        return time.monotonic() - self.t0
