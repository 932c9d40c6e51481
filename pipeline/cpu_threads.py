"""How many CPU threads a model stage's torch may use.

torch gives every process one intra-op thread per core. Stages that run on
the CPU share one host, so `epd-launch --encoders 1 --generators 3` on a
2-core box ran 8 spinning OpenMP threads on 2 cores. In the end-to-end
tests a tiny-model decode step of 3 sequences took 350 ms on CI (47-259 ms
here); with one thread per stage a step takes about 1 ms, and the failover
test that had timed out on CI ran in 20 s here instead of 35 s. The
launcher therefore splits the cores among the CPU stages; a stage started
on its own keeps torch's default, within a cgroup CPU quota.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

from pipeline.arg_parser import at_least_one


def usable_cpus() -> int:
    """Cores this process may use: those it may run on (taskset, cpusets),
    capped by a cgroup CPU quota (systemd's CPUQuota=, a container's --cpus),
    which a plain core count misses."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    quota = cgroup_cpu_quota()
    return cpus if quota is None else max(1, min(cpus, math.ceil(quota)))


def cgroup_cpu_quota(root: Path = Path("/sys/fs/cgroup"),
                     membership: Path = Path("/proc/self/cgroup")) -> float | None:
    """The tightest CPU quota (in cores) on this process's cgroup or its
    parents, v2 (`cpu.max`) or v1 (`cpu.cfs_quota_us`); None without one."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        fields = line.split(":", 2)   # hierarchy id, controllers, path
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":
            base = root  # v2: one hierarchy
        elif "cpu" in controllers.split(","):
            base = root / "cpu"
        else:
            continue
        limits += [q for q in (_quota_at(base / part) for part in _ancestors(path)) if q is not None]
    return min(limits, default=None)


def _ancestors(path: str) -> list[str]:
    """"/a/b" -> ["a/b", "a", ""]: a quota may sit on a parent slice; a
    container sees its own cgroup mounted as the root."""
    parts = [p for p in path.split("/") if p]
    return ["/".join(parts[:n]) for n in range(len(parts), -1, -1)]


def _quota_at(folder: Path) -> float | None:
    try:
        quota, period = (folder / "cpu.max").read_text().split()
    except (OSError, ValueError):
        try:
            quota = (folder / "cpu.cfs_quota_us").read_text().strip()
            period = (folder / "cpu.cfs_period_us").read_text().strip()
        except OSError:
            return None
    if quota in ("max", "-1"):
        return None
    try:
        return int(quota) / int(period)
    except (ValueError, ZeroDivisionError):
        return None


def threads_per_stage(stages: int, cpus: int) -> int:
    """An even share of `cpus` for each of `stages` processes, at least one."""
    return max(1, cpus // max(1, stages))


def add_cpu_threads_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cpu-threads", type=lambda text: at_least_one(text, "threads"), default=None,
                        metavar="N", help="torch's CPU threads in this process (default: one per usable core; "
                        "epd-launch splits the cores among the stages that run on the CPU)")


def apply_cpu_threads(threads: int | None) -> None:
    """Before the model loads: the first parallel op fixes the pool. None
    keeps torch's default, capped at the usable cores (torch counts the
    machine's, not a cgroup quota's)."""
    import torch  # here, not above: the launcher's plan uses this file and must not load torch

    torch.set_num_threads(threads if threads is not None else min(torch.get_num_threads(), usable_cpus()))
