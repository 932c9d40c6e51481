"""Where a generator's time goes, step by step, summed over a window.

The goodput study needs to know why a generator saturates: host work in
the scheduler, GPU work in the forward, local vision forwards (aggregated
mode), or work outside the step (messages, embedding copies). Each step is
timed in phases with time.perf_counter (the forward's phase ends when the
sampled tokens reach the host, so it includes the GPU's time) and summed
per kind of step; `window()` returns the sums since the last call and
starts a new window. `counters()` are running totals since start (steps,
tokens and microseconds per kind; `iteration_counters()`: how many steps
ran how many tokens, in ITERATION_TOKEN_BOUNDS' buckets), which /metrics
exports as Prometheus counters. Recording costs a few dictionary updates per step.
"""

from __future__ import annotations

import bisect
import time
from collections import defaultdict

PHASES = ("schedule", "encode", "forward", "update")
# Upper bounds of the tokens-per-step buckets: vLLM's for
# vllm:iteration_tokens_total (its list where no CUDA graph sizes apply).
ITERATION_TOKEN_BOUNDS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def step_kind(num_tokens: int, num_seqs: int, encodes: int) -> str:
    """decode: one token per sequence; mixed: a prefill chunk among them;
    encode: local vision forwards only; idle: nothing ran."""
    if num_tokens == 0:
        return "encode" if encodes else "idle"
    return "decode" if num_tokens == num_seqs else "mixed"


class StepProfile:
    def __init__(self) -> None:
        self._start = time.monotonic()
        self._steps: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self._totals: dict[str, list[float]] = defaultdict(lambda: [0, 0, 0.0])   # kind -> steps, tokens, s
        self.outside_s = 0.0   # the caller's own work between steps
        self._by_tokens = [0] * (len(ITERATION_TOKEN_BOUNDS) + 1)   # steps per bucket; the last: more

    def record(self, kind: str, phases: dict[str, float], tokens: int, seqs: int) -> None:
        row = self._steps[kind]
        row["steps"] += 1
        row["tokens"] += tokens
        row["seqs"] += seqs
        for phase, seconds in phases.items():
            row[phase + "_s"] += seconds
        total = self._totals[kind]
        total[0] += 1
        total[1] += tokens
        total[2] += sum(phases.values())
        if tokens:
            self._by_tokens[bisect.bisect_left(ITERATION_TOKEN_BOUNDS, tokens)] += 1

    def add_wait(self, kind: str, seconds: float) -> None:
        """A wait for a step already recorded (decode ahead reads a launched
        step's tokens later): its time, in the update phase, and no new step."""
        self._steps[kind]["update_s"] += seconds
        self._totals[kind][2] += seconds

    def counters(self) -> dict[str, int]:
        """{"steps.KIND", "step_tokens.KIND", "step_us.KIND": running totals}."""
        out = {}
        for kind, (steps, tokens, seconds) in self._totals.items():
            out.update({f"steps.{kind}": steps, f"step_tokens.{kind}": tokens, f"step_us.{kind}": int(seconds * 1e6)})
        return out

    def iteration_counters(self) -> dict[str, int]:
        """{"iteration_tokens.B": the steps that ran at most B tokens and
        more than the bound before (B "inf": more than the last)}, every
        bucket: the proxy reads the bounds from the names."""
        return {f"iteration_tokens.{bound}": steps
                for bound, steps in zip((*map(str, ITERATION_TOKEN_BOUNDS), "inf"), self._by_tokens)}

    def window(self) -> dict:
        """{"seconds": window length, "outside_share": ..., kind: {"steps",
        "tokens", "mean_ms", per-phase mean ms, "mean_tokens", "mean_seqs",
        "busy"}}:
        busy is the share of the window spent in steps of that kind."""
        now = time.monotonic()
        seconds = max(now - self._start, 1e-9)
        out: dict = {"seconds": round(seconds, 2), "outside_share": round(self.outside_s / seconds, 3)}
        for kind, row in self._steps.items():
            n = row["steps"] or 1   # a window may hold only a wait for a step of the last one
            total = sum(row[p + "_s"] for p in PHASES)
            out[kind] = {"steps": int(row["steps"]), "tokens": int(row["tokens"]),
                         "mean_ms": round(total / n * 1000, 2),
                         **{f"{p}_ms": round(row[p + "_s"] / n * 1000, 2) for p in PHASES if row[p + "_s"]},
                         "mean_tokens": round(row["tokens"] / n, 1), "mean_seqs": round(row["seqs"] / n, 1),
                         "busy": round(total / seconds, 3)}
        self._start = now
        self._steps.clear()
        self.outside_s = 0.0
        return out
