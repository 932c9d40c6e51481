"""A run's measurement window and its sustained rates: pure functions of the
per-request records (`sent_at`, `done_at`: seconds since the run's start).

A run's arrivals span [0, A] s, A being the last send. The first W s
(--warmup-s) are warm-up, so the window holds the arrivals in [W, A]:

    offered_rate  = arrivals in [W, A] / (A - W)
    achieved_rate = successful completions with done_at in [W + D, A + D] / (A - W)

D is the typical latency: the median E2E (done_at - sent_at; it includes any
wait for a --max-concurrency slot) of the successful warm-up requests, those
sent before W. When none completed (W = 0, or every warm-up request failed),
D is the median of the first SHIFT_SAMPLE completions; under overload that
is biased low, which only moves the completion window earlier.

Why the shift: completions counted over the arrival window itself differ
from the arrivals by the change of the in-flight count, whose fluctuation
(std about sqrt(2 R L) requests at rate R and latency L) is a few percent of
a 30 s window at 12 req/s. Shifted by D, only the latency jitter at the
window's two edges remains. An overloaded stack completes at most its
capacity in any window, so achieved < offered shows even while its queue
is still short enough to meet a TTFT SLO. `sustained` is
achieved / offered >= the fraction (--sustained-fraction).

The window's SLO figures (`window_p99_ttft_ms`, ..., `window_slo_attainment`,
and a mixed load's `window_by_class`) cover the requests sent in [W, A], so
warm-up requests do not count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pipeline.bench.metrics import SLO_METRICS, RequestRecord, is_good

DEFAULT_SUSTAINED_FRACTION = 0.95
# Completions that set D when no warm-up request completed: enough for a
# median, few enough to come from before a queue builds.
SHIFT_SAMPLE = 8


@dataclass(frozen=True)
class WindowSpec:
    warmup_s: float = 0.0
    fraction: float = DEFAULT_SUSTAINED_FRACTION  # achieved/offered a sustained run reaches

    def __post_init__(self) -> None:
        if not self.warmup_s >= 0:
            raise ValueError(f"--warmup-s must be >= 0 (got {self.warmup_s:g})")
        if not 0 <= self.fraction <= 1:
            raise ValueError(f"--sustained-fraction must be in [0, 1] (got {self.fraction:g})")


@dataclass(frozen=True)
class Window:
    start: float  # W
    end: float  # A, the last arrival
    shift: float | None  # D; None while no request has completed

    @property
    def length(self) -> float:
        return self.end - self.start

    def arrivals(self, sent_at: Sequence[float]) -> int:
        return sum(self.start <= t <= self.end for t in sent_at)

    def completions(self, records: Sequence[RequestRecord]) -> int:
        if self.shift is None:
            return 0
        low, high = self.start + self.shift, self.end + self.shift
        return sum(r.success and low <= r.done_at <= high for r in records)

    def as_json(self) -> dict:
        return {"start": self.start, "end": self.end, "shift": self.shift}


def latency_shift(records: Sequence[RequestRecord], warmup_s: float) -> float | None:
    """D: the median E2E of the successful warm-up requests, else of the
    first SHIFT_SAMPLE completions; None when nothing completed."""
    done = [r for r in records if r.success]
    latencies = [r.done_at - r.sent_at for r in done if r.sent_at < warmup_s]
    if not latencies:
        first = sorted(done, key=lambda r: r.done_at)[:SHIFT_SAMPLE]
        latencies = [r.done_at - r.sent_at for r in first]
    return float(np.median(latencies)) if latencies else None


def measurement_window(sent_at: Sequence[float], finished: Sequence[RequestRecord],
                       warmup_s: float) -> Window | None:
    """The window once requests were sent (None before); `finished` holds the
    records so far, so a running step can be judged as well as a whole run."""
    if not sent_at:
        return None
    return Window(warmup_s, max(sent_at), latency_shift(finished, warmup_s))


def sustained_summary(records: Sequence[RequestRecord], spec: WindowSpec) -> dict:
    """offered_rate, achieved_rate, sustained_ratio, window_s, sustained. The
    rates are None when the window is empty (the arrivals ended within the
    warm-up); with arrivals but no completion, achieved is 0."""
    window = measurement_window([r.sent_at for r in records], records, spec.warmup_s)
    out: dict = {"offered_rate": None, "achieved_rate": None, "sustained_ratio": None,
                 "window_s": window.as_json() if window else None, "sustained": None}
    if window is None or not window.length > 0:
        return out
    arrivals = window.arrivals([r.sent_at for r in records])
    offered = arrivals / window.length
    achieved = window.completions(records) / window.length
    ratio = achieved / offered
    out.update(offered_rate=offered, achieved_rate=achieved, sustained_ratio=ratio,
               sustained=ratio >= spec.fraction)
    return out


def _p99_ms(seconds: list[float]) -> float | None:
    return float(np.percentile(np.asarray(seconds) * 1000.0, 99)) if seconds else None


def in_window(records: Sequence[RequestRecord], spec: WindowSpec) -> list[RequestRecord]:
    """The requests sent in [W, A]: those the window's figures are about."""
    end = max((r.sent_at for r in records), default=0.0)
    return [r for r in records if spec.warmup_s <= r.sent_at <= end]


def window_latencies(records: Sequence[RequestRecord], spec: WindowSpec, slos: dict[str, float]) -> dict:
    """P99 TTFT/TPOT/E2EL and SLO attainment over the requests sent in [W, A]
    (failures among them are attainment misses)."""
    inside = in_window(records, spec)
    done = [r for r in inside if r.success]
    values = {"ttft": [r.ttft for r in done], "tpot": [r.tpot for r in done if r.tpot is not None],
              "e2el": [r.e2el for r in done]}
    out: dict = {"window_requests": len(inside), "window_completed": len(done)}
    out.update({f"window_p99_{metric}_ms": _p99_ms(values[metric]) for metric in SLO_METRICS})
    good = sum(is_good(r, slos) for r in done)
    out["window_slo_attainment"] = good / len(inside) if slos and inside else None
    return out


def window_summary(records: Sequence[RequestRecord], spec: WindowSpec, slos: dict[str, float],
                   burst: bool = False) -> dict:
    """Every window key of a run's result. A burst (--request-rate inf) sends
    everything at once: it has no arrival rate, so its rates are None."""
    rates = sustained_summary([] if burst else records, spec)
    return {**rates, **window_latencies(records, spec, slos)}
