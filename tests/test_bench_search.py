"""The goodput search's bisection against fake measurements (exact rates,
budget and bounds), its step rule (SLOs and the sustained check), the step
progress line, and the rate/latency chart."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from conftest import REPO
from pipeline.bench.plot import load_results, plot_series
from pipeline.bench.search import (SearchSettings, describe_step, miss_reasons, parse_search, search_max_goodput,
                                   step_passes, sustained_rate)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SLOS = {"ttft": 2000.0, "tpot": 50.0}


def step_result(rate: float, attainment: float = 1.0, ratio: float = 1.0, **overrides) -> dict:
    """The keys the step rule and the progress line read, as BenchRunner.measure sets them."""
    result = {"request_rate": rate, "num_prompts": 30, "completed": 30, "failed": 0, "cancelled": 0,
              "slo_attainment": attainment, "window_slo_attainment": attainment,
              "request_goodput": rate * attainment, "request_throughput": rate,
              "offered_rate": rate, "achieved_rate": rate * ratio, "sustained_ratio": ratio,
              "window_s": {"start": 4.0, "end": 30.0, "shift": 0.5}, "window_completed": 30,
              "window_p99_ttft_ms": 300.0, "window_p99_tpot_ms": 20.0, "window_p99_e2el_ms": 900.0}
    result.update(overrides)
    return result


def fake_server_with_capacity(capacity: float, clock: list[float] | None = None, step_s: float = 0.0,
                              keeps_up: float = float("inf")):
    """A measurement whose SLO attainment is 1 up to `capacity` req/s and
    0.5 beyond, and which completes at most `keeps_up` req/s; each step
    advances the fake clock by step_s."""
    calls = []

    async def measure(rate: float, index: int) -> dict:
        calls.append((rate, index))
        if clock is not None:
            clock[0] += step_s
        return step_result(rate, 1.0 if rate <= capacity else 0.5, min(1.0, keeps_up / rate))

    return measure, calls


def search(measure, settings, clock=None):
    seen = []
    kwargs = {"clock": lambda: clock[0]} if clock is not None else {}
    found = asyncio.run(search_max_goodput(measure, settings, seen.append, **kwargs))
    return found, seen


def test_bisection_is_geometric_and_finds_the_capacity():
    measure, calls = fake_server_with_capacity(5.0)
    found, seen = search(measure, SearchSettings(1.0, 64.0, SLOS, max_steps=6))
    rates = [rate for rate, _ in calls]
    # 8 miss, 2.83 pass, 4.76 pass, 6.17 miss, 5.42 miss, 5.08 miss
    expected = [8.0, 8 ** 0.5, 8 ** 0.75, 8 ** 0.875, 8 ** 0.8125, 8 ** 0.78125]
    assert rates == pytest.approx(expected)
    assert [index for _, index in calls] == list(range(6))
    assert [s["passed"] for s in found["steps"]] == [False, True, True, False, False, False]
    assert seen == found["steps"]  # each step reported as it was measured
    assert found["max_request_rate"] == pytest.approx(8 ** 0.75)
    assert found["max_request_goodput"] == pytest.approx(8 ** 0.75)
    assert found["bracket"] == pytest.approx([8 ** 0.75, 8 ** 0.78125])
    assert found["at_bound"] is None and found["search"]["target"] == 0.9


def test_all_pass_or_all_miss_say_which_bound_holds_the_answer():
    measure, _ = fake_server_with_capacity(1000.0)
    found, _ = search(measure, SearchSettings(1.0, 16.0, SLOS, max_steps=3))
    assert found["at_bound"] == "high" and found["max_request_rate"] == pytest.approx(16 ** (7 / 8))
    measure, _ = fake_server_with_capacity(0.1)
    found, _ = search(measure, SearchSettings(1.0, 16.0, SLOS, max_steps=3))
    assert found["at_bound"] == "low" and found["max_request_rate"] is None
    assert found["max_request_goodput"] is None


def test_target_resolution_and_budget_bound_the_steps():
    measure, _ = fake_server_with_capacity(5.0)
    found, _ = search(measure, SearchSettings(1.0, 64.0, SLOS, target=0.4, max_steps=3))
    assert all(s["passed"] for s in found["steps"])  # 0.5 attainment meets a 0.4 target
    measure, calls = fake_server_with_capacity(5.0)
    search(measure, SearchSettings(4.0, 4.1, SLOS, resolution=0.02))
    assert len(calls) == 1  # 4.1 / 4.05 is within the resolution: one step, then done
    clock = [0.0]
    measure, calls = fake_server_with_capacity(5.0, clock, step_s=10.0)
    found, _ = search(measure, SearchSettings(1.0, 64.0, SLOS, max_steps=6, budget_s=25.0), clock)
    assert len(calls) == 2  # a third 10 s step would end at 30 s > 25 s


def test_sustained_rate_is_the_lower_of_offered_and_achieved():
    # Achieved counts a shifted window's completions: its edge jitter can
    # put it above the arrivals, and a stack never sustains more than it got.
    assert sustained_rate({"offered_rate": 14.9, "achieved_rate": 16.2}) == 14.9
    assert sustained_rate({"offered_rate": 13.6, "achieved_rate": 13.5}) == 13.5
    assert sustained_rate({"offered_rate": None, "achieved_rate": None}) is None


@pytest.mark.parametrize("kwargs, message", [
    (dict(low=0.0, high=4.0), "0 < LOW < HIGH"), (dict(low=4.0, high=4.0), "0 < LOW < HIGH"),
    (dict(low=1.0, high=float("inf")), "HIGH < inf"), (dict(low=1.0, high=4.0, target=0.0), "--goodput-target"),
    (dict(low=1.0, high=4.0, max_steps=0), "--search-steps"),
    (dict(low=4.0, high=4.1, resolution=0.05), "already within --search-resolution 0.05"),
    (dict(low=1.0, high=4.0, budget_s=0.0), "--search-budget-s"),
    (dict(low=1.0, high=4.0, slos={}), "needs --goodput"),
    (dict(low=1.0, high=4.0, criterion="p50"), "--search-criterion"),
    (dict(low=1.0, high=4.0, sustained_fraction=1.5), "--sustained-fraction"),
    (dict(low=1.0, high=4.0, warmup_s=-1.0), "--warmup-s"),
    (dict(low=1.0, high=4.0, warmup_s=4.0, step_s=4.0), "must be longer than --warmup-s"),
    (dict(low=1.0, high=4.0, drain_timeout_s=0.0), "--drain-timeout-s"),
])
def test_bad_search_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SearchSettings(**{"slos": SLOS, **kwargs})


def test_sustained_check_catches_a_stack_that_meets_its_slos_while_falling_behind():
    # Attainment 1 at every rate, but only 5 req/s completed: the old rule
    # would answer HIGH; the sustained check finds the 5 req/s.
    measure, _ = fake_server_with_capacity(1000.0, keeps_up=5.0)
    found, _ = search(measure, SearchSettings(1.0, 64.0, SLOS, max_steps=6))
    assert [s["passed"] for s in found["steps"]] == [False, True, True, False, False, True]
    assert found["max_request_rate"] == pytest.approx(8 ** 0.78125) and found["at_bound"] is None
    assert found["steps"][0]["miss_reasons"] == ["fell behind: achieved 0.62x offered"]
    best = found["steps"][-1]
    assert found["max_offered_rate"] == best["offered_rate"] and found["max_achieved_rate"] == best["achieved_rate"]
    assert found["max_sustained_rate"] == min(best["offered_rate"], best["achieved_rate"])
    # A fraction of 0 turns the check off; 0.5 lets an 8 req/s step (0.62x) pass.
    measure, _ = fake_server_with_capacity(1000.0, keeps_up=5.0)
    found, _ = search(measure, SearchSettings(1.0, 64.0, SLOS, max_steps=3, sustained_fraction=0.0))
    assert found["at_bound"] == "high"
    assert step_passes(step_result(8.0, ratio=0.62), SearchSettings(1.0, 64.0, SLOS, sustained_fraction=0.5))


def test_p99_criterion_reads_each_slo_metric_window_p99_and_failures():
    settings = SearchSettings(1.0, 4.0, SLOS, criterion="p99")
    good = step_result(2.0, attainment=0.5, window_p99_ttft_ms=2000.0, window_p99_tpot_ms=49.0)
    assert step_passes(good, settings)  # attainment plays no part
    assert miss_reasons({**good, "window_p99_tpot_ms": 50.5}, settings) == ["P99 TPOT 50 ms > 50"]
    assert miss_reasons({**good, "failed": 1}, settings) == ["1 failed"]  # a failure anywhere in the step
    assert step_passes({**good, "window_p99_tpot_ms": None}, settings)  # one-token outputs have no TPOT
    assert not step_passes({**good, "window_completed": 0}, settings)
    # The SLO metrics of the whole run (warm-up included) are not what is judged.
    assert step_passes({**good, "p99_ttft_ms": 9000.0}, settings)
    behind = {**good, "sustained_ratio": 0.8, "failed": 3, "cancelled": 3, "window_p99_ttft_ms": 2500.0}
    assert miss_reasons(behind, settings) == ["fell behind: achieved 0.80x offered", "3 failed",
                                              "P99 TTFT 2500 ms > 2000"]
    empty = {**good, "sustained_ratio": None, "window_s": {"start": 4.0, "end": 2.5, "shift": 0.5}}
    assert miss_reasons(empty, settings) == ["no measurement window (arrivals ended at 2.5 s, warm-up 4 s)"]


def test_step_progress_line_says_what_was_offered_achieved_and_why_it_missed():
    settings = SearchSettings(1.0, 64.0, SLOS, criterion="p99")
    miss = step_result(12.0, ratio=0.82, failed=40, cancelled=40, window_p99_tpot_ms=61.0)
    miss["miss_reasons"] = miss_reasons(miss, settings)
    miss["passed"] = False
    assert describe_step(3, miss, settings) == (
        "epd-bench: step 3: rate 12 req/s (30 requests): offered 12, achieved 9.84 req/s (0.82x), "
        "P99 TTFT 300 ms, TPOT 61 ms, 40 cancelled -> miss (fell behind: achieved 0.82x offered; 40 failed; "
        "P99 TPOT 61 ms > 50)")
    ok = {**step_result(6.0), "passed": True, "miss_reasons": []}
    line = describe_step(1, ok, SearchSettings(1.0, 64.0, SLOS))
    assert line.endswith("(1.00x), P99 TTFT 300 ms, TPOT 20 ms, SLO attainment 1.000 -> pass")


def test_parse_search():
    assert parse_search("search:0.5:32") == (0.5, 32.0)
    assert parse_search("2,4") is None and parse_search("inf") is None
    for bad in ("search:1", "search:a:b", "search:1:2:3"):
        with pytest.raises(ValueError, match="search:LOW:HIGH"):
            parse_search(bad)


# ---- the chart ------------------------------------------------------------------------

def result(rate, ttft, tpot):
    return {"request_rate": rate, "p99_ttft_ms": ttft, "p99_tpot_ms": tpot}


def test_plot_two_configurations(tmp_path):
    series = {"EPD": [result(4.0, 300, 20), result(2.0, 200, 15), result("inf", 900, 60)],
              "aggregated": [result(2.0, 400, 30), result(4.0, 2500, None)]}
    out = plot_series(series, tmp_path / "chart.png", {"ttft": 2000, "tpot": 50}, title="EPD vs aggregated")
    data = out.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000
    with pytest.raises(ValueError, match="no result has a finite request rate"):
        plot_series({"x": [result("inf", 1, 1)]}, tmp_path / "none.png")


def test_plot_cli_reads_every_result_layout(tmp_path):
    (tmp_path / "one.json").write_text(json.dumps(result(1.0, 100, 10)))
    (tmp_path / "sweep.json").write_text(json.dumps([result(1.0, 120, 12), result(3.0, 180, 14)]))
    (tmp_path / "search.json").write_text(json.dumps({"steps": [result(2.0, 150, 11)], "max_request_rate": 2.0}))
    assert [len(load_results(tmp_path / name)) for name in ("one.json", "sweep.json", "search.json")] == [1, 2, 1]
    cli = [sys.executable, str(REPO / "bin" / "epd-bench-plot")]
    out = tmp_path / "chart.png"
    proc = subprocess.run([*cli, "--series", f"one={tmp_path / 'one.json'}", "--series",
                           f"sweep={tmp_path / 'sweep.json'}", "--series", f"search={tmp_path / 'search.json'}",
                           "--goodput", "ttft:2000", "tpot:50", "--out", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert out.read_bytes()[:8] == PNG_MAGIC
    for args, fragment in ((["--series", "nolabel", "--out", str(out)], "expected LABEL=FILE"),
                           (["--series", f"x={tmp_path / 'missing.json'}", "--out", str(out)], "cannot read")):
        proc = subprocess.run([*cli, *args], capture_output=True, text=True, timeout=60)
        assert proc.returncode != 0
        assert proc.stderr.count("\n") == 1 and fragment in proc.stderr
