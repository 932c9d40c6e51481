"""When a search step stops waiting for its requests: pure functions of the
records so far and the time, which the runner (client.py) asks at the times
they name (and after each completion until one succeeds and D is known).

A step is judged once every request was sent. Let the window be [W, A] and
the shift D (window.py). At A + D + grace, grace = max(min_grace_s,
grace_share * D) (2 s and half of D by default: time for the warm-up
stragglers to settle D), completions with done_at in [W + D, A + D] can no
longer grow; if they are fewer than fraction * arrivals in [W, A] the step
cannot be sustained, and the requests still running are cancelled
(FELL_BEHIND). A step still running at A + D + drain_timeout_s has its rest
cancelled too (DRAIN_TIMEOUT); while no request has completed (D unknown)
that deadline is A + drain_timeout_s. Either way an overloaded step does not
wait minutes for its queue, and the next step starts on an idle server.
Fixed-rate runs have no stop rule: they wait for every request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipeline.bench.metrics import RequestRecord
from pipeline.bench.window import Window, WindowSpec, measurement_window

DEFAULT_DRAIN_TIMEOUT_S = 60.0
CANCELLED = "cancelled:"  # the error prefix of every request the runner cancelled
FELL_BEHIND = "cancelled: the step fell behind its offered rate"
DRAIN_TIMEOUT = "cancelled: not done by the drain timeout"


@dataclass(frozen=True)
class StopRule:
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    min_grace_s: float = 2.0
    grace_share: float = 0.5

    def __post_init__(self) -> None:
        if not self.drain_timeout_s > 0:
            raise ValueError(f"--drain-timeout-s must be > 0 (got {self.drain_timeout_s:g})")
        if not (self.min_grace_s >= 0 and self.grace_share >= 0):
            raise ValueError("the stop rule's grace must be >= 0")

    def verdict_at(self, window: Window) -> float | None:
        """When completions in the shifted window are final (None: D unknown)."""
        if window.shift is None:
            return None
        return window.end + window.shift + max(self.min_grace_s, self.grace_share * window.shift)

    def drain_deadline(self, window: Window) -> float:
        return window.end + (window.shift or 0.0) + self.drain_timeout_s


def stop_reason(sent_at: Sequence[float], finished: Sequence[RequestRecord], now: float,
                spec: WindowSpec, rule: StopRule) -> str | None:
    """Why the requests still running should be cancelled at `now`, or None
    to keep waiting. `sent_at` holds every arrival of the step (all sent)."""
    window = measurement_window(sent_at, finished, spec.warmup_s)
    if window is None or len(finished) >= len(sent_at):
        return None
    verdict = rule.verdict_at(window)
    judged = spec.fraction > 0 and window.length > 0 and verdict is not None
    if judged and now >= verdict and window.completions(finished) < spec.fraction * window.arrivals(sent_at):
        return FELL_BEHIND
    if now >= rule.drain_deadline(window):
        return DRAIN_TIMEOUT
    return None


def next_check_at(sent_at: Sequence[float], finished: Sequence[RequestRecord], now: float,
                  spec: WindowSpec, rule: StopRule) -> float:
    """The first time after `now` at which stop_reason can change its answer
    without another completion (a completion can change D, so the runner
    asks again after each)."""
    window = measurement_window(sent_at, finished, spec.warmup_s)
    if window is None:
        return now
    times = [rule.drain_deadline(window)]
    verdict = rule.verdict_at(window)
    if verdict is not None and spec.fraction > 0 and window.length > 0:
        times.append(verdict)
    return min((t for t in times if t > now), default=now)
