"""The soak's view of a launched stack: which process each stage is now
(from the launcher's "started <instance> (pid N, ...)" lines), their RSS
over time, the stage gauges in /metrics, and what is left once the
launcher has stopped.

Every process of the run carries a mark in its environment (the launcher
passes its own on to the stages), so a stray is found by the mark, not by
a pid that the system may have handed to someone else since.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.arena.shm import our_segments, pid_alive

MARK_VAR = "EPD_SOAK_RUN"
STARTED = re.compile(r"^epd-launch: started (?P<instance>\S+) \(pid (?P<pid>\d+),")
SEGMENT_PID = re.compile(r"-(?P<pid>\d+)-[a-z][a-z0-9]*$")
IDLE_GAUGES = ("epd_arena_leases", "epd_kv_blocks_used", "epd_running_requests", "epd_waiting_requests")


@dataclass
class Incarnation:
    """One process of a stage; `samples` are (seconds after t0, VmRSS, RssAnon, RssShmem), KiB."""

    instance: str
    pid: int
    seen_s: float                 # when its start line was read (an upper bound of its start)
    samples: list[tuple[float, int, int, int]] = field(default_factory=list)


class Stages:
    """The stages of one launcher, from its log, followed across restarts."""

    def __init__(self, launcher_log: Path, t0: float) -> None:
        self.log = launcher_log
        self.t0 = t0
        self.offset = 0
        self.incarnations: list[Incarnation] = []
        self.current: dict[str, Incarnation] = {}

    def refresh(self) -> None:
        """Read the log lines written since the last call."""
        try:
            with open(self.log, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1    # a half-written line waits for the next call
        self.offset += end
        for line in data[:end].decode("utf-8", "replace").splitlines():
            if match := STARTED.match(line):
                inc = Incarnation(match["instance"], int(match["pid"]), time.monotonic() - self.t0)
                self.incarnations.append(inc)
                self.current[inc.instance] = inc

    def pid(self, instance: str) -> int | None:
        self.refresh()
        inc = self.current.get(instance)
        return inc.pid if inc else None

    def instances(self, role: str) -> list[str]:
        self.refresh()
        return sorted(name for name in self.current if name == role or name.startswith(role + "-"))

    def all_pids(self) -> set[int]:
        self.refresh()
        return {inc.pid for inc in self.incarnations}

    def sample_rss(self) -> None:
        self.refresh()
        now = time.monotonic() - self.t0
        for inc in self.current.values():
            if (values := read_rss(inc.pid)) is not None:
                inc.samples.append((round(now, 2), *values))


def read_rss(pid: int) -> tuple[int, int, int] | None:
    """VmRSS, RssAnon and RssShmem of a live process, in KiB."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    try:
        return tuple(int(fields[name].split()[0]) for name in ("VmRSS", "RssAnon", "RssShmem"))
    except (KeyError, ValueError, IndexError):
        return None    # a zombie has no memory lines


def carries_mark(pid: int, mark: str) -> bool:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return f"{MARK_VAR}={mark}".encode() in environ


def signal_stage(pid: int, sig: int, mark: str) -> bool:
    """Send `sig` only to a process of this run (the pid may be someone else's by now)."""
    if not carries_mark(pid, mark):
        return False
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> the sum of each series' samples over its labels."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            name = key.split("{")[0]
            try:
                out[name] = out.get(name, 0.0) + float(value)
            except ValueError:
                continue
    return out


def strays(mark: str) -> list[dict]:
    """Live processes other than this one whose environment carries the mark."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid() and carries_mark(int(entry.name), mark):
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
                state = next(l for l in (entry / "status").read_text().splitlines() if l.startswith("State:"))
            except (OSError, StopIteration):
                continue
            found.append({"pid": int(entry.name), "state": state.split(":", 1)[1].strip(), "cmdline": cmdline[:200]})
    return found


def segments_of(pids: set[int]) -> list[str]:
    """Our /dev/shm segments made by one of `pids` (names end in -<pid>-<role>)."""
    return [name for name in our_segments() if (m := SEGMENT_PID.search(name)) and int(m["pid"]) in pids]


def stop_launcher(proc: subprocess.Popen, timeout_s: float) -> dict:
    """SIGTERM and wait; SIGKILL the launcher's group if it hangs."""
    started = time.monotonic()
    killed = False
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            killed = True
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return {"exit_code": proc.returncode, "stop_s": round(time.monotonic() - started, 2), "killed": killed}


def leftovers(stages: Stages, mark: str, run_dir: Path) -> dict:
    """What the run left behind after the launcher stopped."""
    pids = stages.all_pids()
    return {"shm_left": segments_of(pids), "strays": strays(mark),
            "stage_pids_alive": sorted(p for p in pids if pid_alive(p) and carries_mark(p, mark)),
            "sockets_left": sorted(p.name for p in run_dir.glob("*.sock")) if run_dir.is_dir() else []}
