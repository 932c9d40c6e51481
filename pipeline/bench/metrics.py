"""Pure functions from per-request timing records to the benchmark result.

Result keys follow vLLM's bench client (`completed`, `mean_ttft_ms`, ...).
Times inside records are seconds; the result reports milliseconds. A metric
with no samples (e.g. TPOT when every request produced one token) is None,
not 0, so an empty sample is never mistaken for a fast one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

SLO_METRICS = ("ttft", "tpot", "e2el")
PERCENTILES = (("median", 50), ("p90", 90), ("p99", 99))


@dataclass
class RequestRecord:
    """What one request measured. Failed requests keep their error text."""

    success: bool
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    e2el: float = 0.0
    error: str = ""
    num_images: int = 0
    # Seconds since the run's start (perf_counter): when the request arrived
    # in the open-loop schedule, and when its stream ended or failed. The
    # measurement window (window.py) is built from these.
    sent_at: float = 0.0
    done_at: float = 0.0

    @property
    def tpot(self) -> float | None:
        # Server-reported completion tokens, not chunk count: one chunk may
        # carry several tokens.
        if self.completion_tokens < 2:
            return None
        return (self.e2el - self.ttft) / (self.completion_tokens - 1)


def parse_goodput(items: list[str]) -> dict[str, float]:
    """Parse `ttft:MS tpot:MS e2el:MS` (any subset) into {metric: ms}."""
    slos: dict[str, float] = {}
    for item in items:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"--goodput item {item!r} must be NAME:MS with NAME one of {', '.join(SLO_METRICS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--goodput item {item!r}: {value!r} is not a number of milliseconds") from None
        if not ms >= 0:
            raise ValueError(f"--goodput item {item!r}: milliseconds must be >= 0")
        slos[name] = ms
    return slos


def is_good(record: RequestRecord, slos: dict[str, float]) -> bool:
    """A completed request is good when it meets every given SLO (<= limit)."""
    if not record.success:
        return False
    values = {"ttft": record.ttft, "tpot": record.tpot, "e2el": record.e2el}
    for name, limit_ms in slos.items():
        value = values[name]
        # A request without a TPOT (one output token) has no decode phase to
        # violate the TPOT SLO.
        if value is not None and value * 1000.0 > limit_ms:
            return False
    return True


def _stats(prefix: str, seconds: list[float]) -> dict[str, float | None]:
    if not seconds:
        out: dict[str, float | None] = {f"mean_{prefix}_ms": None}
        out.update({f"{name}_{prefix}_ms": None for name, _ in PERCENTILES})
        return out
    ms = np.asarray(seconds, dtype=np.float64) * 1000.0
    out = {f"mean_{prefix}_ms": float(ms.mean())}
    out.update({f"{name}_{prefix}_ms": float(np.percentile(ms, q)) for name, q in PERCENTILES})
    return out


def summarize(records: list[RequestRecord], duration: float, slos: dict[str, float] | None = None) -> dict:
    """The result dict for one run. `duration` is wall seconds, first send to last finish."""
    if duration <= 0:
        raise ValueError("duration must be positive")
    done = [r for r in records if r.success]
    output_tokens = sum(r.completion_tokens for r in done)
    result: dict = {
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration": duration,
        "total_input_tokens": sum(r.prompt_tokens for r in done),
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "request_goodput": None,
        "output_throughput": output_tokens / duration,
    }
    if slos:
        good = sum(is_good(r, slos) for r in done)
        result["request_goodput"] = good / duration
        # Not a vLLM key: the fraction of sent requests that met every SLO
        # (failures are misses), which the goodput search compares to its target.
        result["slo_attainment"] = good / len(records) if records else None
    result.update(_stats("ttft", [r.ttft for r in done]))
    result.update(_stats("tpot", [r.tpot for r in done if r.tpot is not None]))
    result.update(_stats("itl", [gap for r in done for gap in r.itl]))
    result.update(_stats("e2el", [r.e2el for r in done]))
    result["errors"] = [r.error for r in records if not r.success]
    return result


def by_class(records: list[RequestRecord]) -> dict[str, dict]:
    """TTFT and TPOT of text-only requests and of requests with images apart:
    in a mixed load, whether the text-only streams keep their latency."""
    out = {}
    for name, members in (("text_only", [r for r in records if r.num_images == 0]),
                          ("with_images", [r for r in records if r.num_images > 0])):
        done = [r for r in members if r.success]
        stats = {"requests": len(members), "completed": len(done)}
        stats.update(_stats("ttft", [r.ttft for r in done]))
        stats.update(_stats("tpot", [r.tpot for r in done if r.tpot is not None]))
        out[name] = stats
    return out



# --save-detailed: per-request columns, so a run's window can be measured
# again afterwards with other settings (records_from_detailed inverts it).
# vLLM's names where it has them (input_lens, output_lens, ttfts, errors).
DETAILED_COLUMNS = (("input_lens", "prompt_tokens"), ("output_lens", "completion_tokens"), ("ttfts", "ttft"),
                    ("e2els", "e2el"), ("num_images", "num_images"), ("sent_at", "sent_at"),
                    ("done_at", "done_at"), ("success", "success"), ("errors", "error"))


def detailed(records: list[RequestRecord]) -> dict[str, list]:
    return {column: [getattr(r, attr) for r in records] for column, attr in DETAILED_COLUMNS}


def records_from_detailed(columns: dict[str, list]) -> list[RequestRecord]:
    rows = zip(*(columns[column] for column, _ in DETAILED_COLUMNS))
    return [RequestRecord(**{attr: value for (_, attr), value in zip(DETAILED_COLUMNS, row)}) for row in rows]
