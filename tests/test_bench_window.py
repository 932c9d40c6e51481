"""epd-bench's measurement window (offered and achieved rates, the latency
shift, window SLO figures) and the stop rule of a search step, on hand-made
records with exact times (multiples of 1/8 s, exact in binary)."""

from __future__ import annotations

import pytest

from pipeline.bench.metrics import RequestRecord, by_class
from pipeline.bench.stop import DRAIN_TIMEOUT, FELL_BEHIND, StopRule, next_check_at, stop_reason
from pipeline.bench.window import (SHIFT_SAMPLE, WindowSpec, in_window, latency_shift, sustained_summary,
                                   window_latencies, window_summary)

ARRIVALS = [i / 8 for i in range(81)]  # 8 req/s over [0, 10] s


def rec(sent: float, latency: float, success: bool = True, ttft: float = 0.05, tokens: int = 5) -> RequestRecord:
    return RequestRecord(success, completion_tokens=tokens if success else 0, ttft=ttft, e2el=latency,
                         error="" if success else "HTTP 500: x", sent_at=sent, done_at=sent + latency)


def fifo_queue(arrivals: list[float], service_s: float) -> list[RequestRecord]:
    """One server taking service_s per request, first come first served."""
    records, free_at = [], 0.0
    for sent in arrivals:
        free_at = max(free_at, sent) + service_s
        records.append(rec(sent, free_at - sent))
    return records


def test_steady_load_is_sustained_exactly():
    records = [rec(t, 0.5) for t in ARRIVALS]
    out = sustained_summary(records, WindowSpec(warmup_s=2.0))
    # Arrivals i/8 for i in 16..80 lie in [2, 10]; their completions in [2.5, 10.5].
    assert out["window_s"] == {"start": 2.0, "end": 10.0, "shift": 0.5}
    assert out["offered_rate"] == 65 / 8 and out["achieved_rate"] == 65 / 8
    assert out["sustained_ratio"] == 1.0 and out["sustained"] is True


def test_overload_shows_as_achieved_below_offered():
    # 8 req/s offered to a 4 req/s server: request i ends at 0.25 (i + 1).
    records = fifo_queue(ARRIVALS, 0.25)
    out = sustained_summary(records, WindowSpec(warmup_s=2.0))
    # D: the median of the warm-up latencies 0.25 + i/8, i in 0..15.
    assert out["window_s"]["shift"] == 0.25 + 7.5 / 8
    # Completions in [3.1875, 11.1875]: 0.25 (i + 1) for i + 1 in 13..44.
    assert out["achieved_rate"] == 32 / 8 and out["offered_rate"] == 65 / 8
    assert out["sustained_ratio"] == pytest.approx(32 / 65) and out["sustained"] is False
    # A lower fraction accepts what a higher one rejects; 0 accepts anything.
    assert sustained_summary(records, WindowSpec(2.0, fraction=0.4))["sustained"] is True
    assert sustained_summary(records, WindowSpec(2.0, fraction=0.0))["sustained"] is True


def test_shift_without_completed_warmup_uses_the_first_completions():
    # No warm-up (W = 0): the first SHIFT_SAMPLE completions by done_at set D,
    # not a slow request sent early that ends late.
    records = [rec(0.0, 9.0)] + [rec(i / 8, 0.5 + i / 8) for i in range(1, 20)]
    # The first 8 to end are i = 1..8 (latencies 0.625..1.5); their median
    # lies between i = 4 and i = 5.
    assert SHIFT_SAMPLE == 8 and latency_shift(records, 0.0) == (1.0 + 1.125) / 2
    # Every warm-up request failed: the same fallback.
    failed_warmup = [rec(i / 8, 0.3, success=False) for i in range(8)] + [rec(1 + i / 8, 0.5) for i in range(12)]
    assert latency_shift(failed_warmup, 1.0) == 0.5
    assert latency_shift([rec(0.0, 1.0, success=False)], 0.0) is None


def test_no_completion_and_empty_window():
    failed = [rec(t, 0.5, success=False) for t in ARRIVALS]
    out = sustained_summary(failed, WindowSpec(warmup_s=2.0))
    assert out["offered_rate"] == 65 / 8 and out["achieved_rate"] == 0.0
    assert out["sustained_ratio"] == 0.0 and out["sustained"] is False and out["window_s"]["shift"] is None
    # Arrivals that end within the warm-up leave no window to measure.
    early = [rec(i / 8, 0.5) for i in range(20)]
    out = sustained_summary(early, WindowSpec(warmup_s=4.0))
    assert out["offered_rate"] is None and out["sustained_ratio"] is None and out["sustained"] is None
    assert out["window_s"]["end"] == 19 / 8
    # A burst has no rate at all, whatever its records say.
    assert window_summary(early, WindowSpec(), {}, burst=True)["offered_rate"] is None


def test_window_slo_figures_leave_the_warmup_out():
    slow_warmup = [rec(i / 8, 3.0, ttft=2.5) for i in range(16)]
    window = [rec(2 + i / 8, 0.5, ttft=0.1) for i in range(40)] + [rec(7.0, 0.5, success=False)]
    out = window_latencies(slow_warmup + window, WindowSpec(warmup_s=2.0), {"ttft": 200})
    assert out["window_requests"] == 41 and out["window_completed"] == 40
    assert out["window_p99_ttft_ms"] == pytest.approx(100.0) and out["window_p99_e2el_ms"] == pytest.approx(500.0)
    assert out["window_p99_tpot_ms"] == pytest.approx(100.0)  # (0.5 - 0.1) / 4
    assert out["window_slo_attainment"] == pytest.approx(40 / 41)  # the failure is a miss
    # Counted from 0, the warm-up's 2.5 s TTFTs would dominate the P99.
    everything = window_latencies(slow_warmup + window, WindowSpec(), {"ttft": 200})
    assert everything["window_p99_ttft_ms"] > 2000 and everything["window_slo_attainment"] == pytest.approx(40 / 57)
    assert window_latencies(window, WindowSpec(), {})["window_slo_attainment"] is None


def test_a_mixed_loads_classes_are_measured_in_the_window_too():
    # Text-only requests whose TPOT is 200 ms in the warm-up and 25 ms after it.
    warmup = [rec(i / 8, 0.85, ttft=0.05) for i in range(16)]
    steady = [rec(2 + i / 8, 0.15, ttft=0.05) for i in range(40)]
    images = [RequestRecord(True, completion_tokens=5, ttft=0.3, e2el=0.5, num_images=4, sent_at=t, done_at=t + 0.5)
              for t in (1.0, 3.0, 4.0)]
    inside = in_window(warmup + steady + images, WindowSpec(warmup_s=2.0))
    assert len(inside) == 42 and all(r.sent_at >= 2.0 for r in inside)
    classes = by_class(inside)
    assert classes["text_only"]["requests"] == 40 and classes["with_images"]["requests"] == 2
    assert classes["text_only"]["p99_tpot_ms"] == pytest.approx(25.0)
    assert by_class(warmup + steady + images)["text_only"]["p99_tpot_ms"] == pytest.approx(200.0)


@pytest.mark.parametrize("kwargs, message", [(dict(warmup_s=-1.0), "--warmup-s"),
                                             (dict(fraction=1.5), "--sustained-fraction")])
def test_bad_window_spec(kwargs, message):
    with pytest.raises(ValueError, match=message):
        WindowSpec(**kwargs)


# ---- the stop rule ---------------------------------------------------------------------

SPEC = WindowSpec(warmup_s=2.0)
RULE = StopRule(drain_timeout_s=60.0)
WARMUP_DONE = [rec(i / 8, 0.5) for i in range(16)]  # D = 0.5: verdict at 10 + 0.5 + 2


def test_a_step_that_fell_behind_stops_at_its_verdict_time():
    finished = WARMUP_DONE + [rec(2 + i / 8, 0.5) for i in range(30)]  # 30 of 65 window arrivals
    assert stop_reason(ARRIVALS, finished, 12.49, SPEC, RULE) is None
    assert next_check_at(ARRIVALS, finished, 11.0, SPEC, RULE) == 12.5
    assert stop_reason(ARRIVALS, finished, 12.5, SPEC, RULE) == FELL_BEHIND
    # With the sustained check off only the drain timeout stops it.
    off = WindowSpec(2.0, fraction=0.0)
    assert stop_reason(ARRIVALS, finished, 12.5, off, RULE) is None
    assert next_check_at(ARRIVALS, finished, 12.5, off, RULE) == 70.5
    assert stop_reason(ARRIVALS, finished, 70.5, off, RULE) == DRAIN_TIMEOUT


def test_a_sustained_step_waits_for_its_stragglers_until_the_drain_timeout():
    finished = WARMUP_DONE + [rec(2 + i / 8, 0.5) for i in range(62)]  # 62 >= 0.95 * 65
    assert stop_reason(ARRIVALS, finished, 12.5, SPEC, RULE) is None
    assert next_check_at(ARRIVALS, finished, 12.5, SPEC, RULE) == 70.5
    assert stop_reason(ARRIVALS, finished, 70.49, SPEC, RULE) is None
    assert stop_reason(ARRIVALS, finished, 70.5, SPEC, RULE) == DRAIN_TIMEOUT
    # Once every request is done there is nothing to cancel.
    everything = WARMUP_DONE + [rec(2 + i / 8, 0.5) for i in range(65)]
    assert stop_reason(ARRIVALS, everything, 1000.0, SPEC, RULE) is None


def test_grace_grows_with_the_latency_and_no_completion_waits_for_the_drain():
    slow = [rec(i / 8, 10.0) for i in range(16)]  # D = 10: grace max(2, 5) = 5
    assert next_check_at(ARRIVALS, slow, 11.0, SPEC, RULE) == 25.0
    assert stop_reason(ARRIVALS, slow, 24.9, SPEC, RULE) is None
    assert stop_reason(ARRIVALS, slow, 25.0, SPEC, RULE) == FELL_BEHIND
    # Nothing completed: D is unknown, so only the drain timeout from A applies.
    assert next_check_at(ARRIVALS, [], 11.0, SPEC, RULE) == 70.0
    assert stop_reason(ARRIVALS, [], 69.9, SPEC, RULE) is None
    assert stop_reason(ARRIVALS, [], 70.0, SPEC, RULE) == DRAIN_TIMEOUT
    with pytest.raises(ValueError, match="--drain-timeout-s"):
        StopRule(drain_timeout_s=0.0)
