"""How many CPU threads a model stage's torch may use.

torch gives every process one intra-op thread per core. Stages that run on
the CPU share one host, so `epd-launch --encoders 1 --generators 3` on a
2-core box ran 8 spinning OpenMP threads on 2 cores: measured in the
end-to-end tests, a decode step of 3 sequences took 350 ms on CI against
47 ms here, and one thread per stage ran the same test in 20 s instead of
35 s. The launcher therefore splits the cores among the CPU stages; a stage
started on its own keeps torch's default.
"""

from __future__ import annotations

import argparse
import os

from pipeline.arg_parser import at_least_one


def usable_cpus() -> int:
    """Cores this process may run on (taskset and cpusets count; the
    machine's total does not)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def threads_per_stage(stages: int, cpus: int) -> int:
    """An even share of `cpus` for each of `stages` processes, at least one."""
    return max(1, cpus // max(1, stages))


def add_cpu_threads_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cpu-threads", type=lambda text: at_least_one(text, "threads"), default=None,
                        metavar="N", help="torch's CPU threads in this process (default: one per usable core; "
                        "epd-launch splits the cores among the stages that run on the CPU)")


def apply_cpu_threads(threads: int | None) -> None:
    """Before the model loads: the first parallel op fixes the pool."""
    import torch  # here, not above: the launcher's plan uses this file and must not load torch

    if threads is not None:
        torch.set_num_threads(threads)
