"""Bisect the request rate for the maximum goodput under latency SLOs.

A step runs the workload at one rate for --search-step-s seconds of
arrivals (window.py measures it: the first --warmup-s seconds are warm-up)
and passes when both hold:

- it was sustained: its achieved rate (completions in the arrival window
  shifted by the typical latency) is at least --sustained-fraction of its
  offered rate (the arrivals in the window; 0 turns this check off). A short
  step used to pass an overloaded stack whose queue was still under the TTFT
  SLO; completions are capped by capacity in any window, so this shows.
- its SLO criterion holds over the requests sent in the window. With
  `attainment` (the default), the fraction of them that completed and met
  every --goodput SLO (failures are misses) is at least the target; the
  default 0.9 is the SLO attainment of DistServe's goodput definition. With
  `p99`, no request of the whole step failed and each SLO's metric has its
  P99 within the SLO: the "goodput at P99 TTFT <= X and P99 TPOT <= Y" of
  vLLM's disaggregated-encoder study and of our issue 6.

A step that fell behind is cut short and what it left running is cancelled
(stop.py), so it counts failures and misses; a step's `miss_reasons` say
why it missed.

The search bisects geometrically (rates span orders of magnitude): the first
step is the geometric middle of [low, high]; a pass raises the lower end, a
miss lowers the upper end. It stops after `max_steps` steps, once
high/low <= 1 + resolution, or when the next step would likely overrun the
time budget. The answer is the highest passing rate measured (None when
every step missed: the maximum lies below `low`, or no SLO can be met).
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass

from pipeline.bench.stop import DEFAULT_DRAIN_TIMEOUT_S, StopRule
from pipeline.bench.window import DEFAULT_SUSTAINED_FRACTION, WindowSpec

DEFAULT_TARGET = 0.9
CRITERIA = ("attainment", "p99")
DEFAULT_WARMUP_S = 4.0
DEFAULT_STEP_S = 30.0  # long enough for an overloaded stack's queue to show


@dataclass(frozen=True)
class SearchSettings:
    low: float
    high: float
    slos: dict[str, float]  # metric -> ms, as --goodput
    criterion: str = "attainment"
    target: float = DEFAULT_TARGET  # attainment criterion only
    max_steps: int = 6
    resolution: float = 0.05  # stop when the bracket's ratio is within this
    budget_s: float | None = None  # wall seconds for all steps together
    sustained_fraction: float = DEFAULT_SUSTAINED_FRACTION  # 0: no sustained check
    warmup_s: float = DEFAULT_WARMUP_S
    step_s: float = DEFAULT_STEP_S  # seconds of arrivals per step
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S

    def __post_init__(self) -> None:
        if not (0 < self.low < self.high and math.isfinite(self.high)):
            raise ValueError(f"--request-rate search:LOW:HIGH needs 0 < LOW < HIGH < inf "
                             f"(got {self.low:g}:{self.high:g})")
        if not self.slos:
            raise ValueError("--request-rate search:LOW:HIGH needs --goodput SLOs to search under")
        if self.criterion not in CRITERIA:
            raise ValueError(f"--search-criterion must be one of {', '.join(CRITERIA)} (got {self.criterion!r})")
        if not 0 < self.target <= 1:
            raise ValueError(f"--goodput-target must be in (0, 1] (got {self.target:g})")
        if self.max_steps < 1:
            raise ValueError(f"--search-steps must be >= 1 (got {self.max_steps})")
        if not self.resolution > 0:
            raise ValueError(f"--search-resolution must be > 0 (got {self.resolution:g})")
        if not self.high / self.low > 1 + self.resolution:
            # Such a search would run no step and then report that none passed.
            raise ValueError(f"--request-rate search:{self.low:g}:{self.high:g} is already within "
                             f"--search-resolution {self.resolution:g}: widen it or lower the resolution")
        if self.budget_s is not None and not self.budget_s > 0:
            raise ValueError(f"--search-budget-s must be > 0 (got {self.budget_s:g})")
        self.window()  # built to validate their fields; their errors name the flags
        self.stop()
        if not self.step_s > 0:
            raise ValueError(f"--search-step-s must be > 0 (got {self.step_s:g})")
        if not self.step_s > self.warmup_s:
            raise ValueError(f"--search-step-s ({self.step_s:g}) must be longer than --warmup-s "
                             f"({self.warmup_s:g}): a step is measured on the arrivals after its warm-up")

    def window(self) -> WindowSpec:
        return WindowSpec(self.warmup_s, self.sustained_fraction)

    def stop(self) -> StopRule:
        return StopRule(self.drain_timeout_s)


def parse_search(text: str) -> tuple[float, float] | None:
    """`search:LOW:HIGH` -> (low, high); any other --request-rate -> None."""
    if not text.startswith("search:"):
        return None
    parts = text.split(":")
    try:
        low, high = (float(part) for part in parts[1:])
    except ValueError:
        raise ValueError(f"--request-rate {text!r} must be search:LOW:HIGH with two numbers") from None
    return low, high


def miss_reasons(result: dict, settings: SearchSettings) -> list[str]:
    """Why a step's result misses, most basic first; empty when it passes."""
    reasons = []
    if settings.sustained_fraction > 0:
        ratio = result["sustained_ratio"]
        if ratio is None:
            window = result["window_s"] or {}
            reasons.append(f"no measurement window (arrivals ended at {window.get('end', 0):.1f} s, "
                           f"warm-up {settings.warmup_s:g} s)")
        elif ratio < settings.sustained_fraction:
            reasons.append(f"fell behind: achieved {ratio:.2f}x offered")
    if settings.criterion == "p99":
        if result["failed"]:
            reasons.append(f"{result['failed']} failed")
        if not result["window_completed"]:
            reasons.append("no request in the window completed")
        for metric, limit in settings.slos.items():
            value = result[f"window_p99_{metric}_ms"]
            # A metric without samples (TPOT of one-token outputs) cannot miss its SLO.
            if value is not None and value > limit:
                reasons.append(f"P99 {metric.upper()} {value:.0f} ms > {limit:g}")
    else:
        attainment = result["window_slo_attainment"]
        if attainment is None or attainment < settings.target:
            shown = "n/a" if attainment is None else f"{attainment:.3f}"
            reasons.append(f"SLO attainment {shown} < {settings.target:g}")
    return reasons


def step_passes(result: dict, settings: SearchSettings) -> bool:
    return not miss_reasons(result, settings)


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def describe_step(number: int, result: dict, settings: SearchSettings) -> str:
    """The progress line of a measured step (with `passed` and `miss_reasons`)."""
    ratio = result["sustained_ratio"]
    line = (f"epd-bench: step {number}: rate {result['request_rate']:.3g} req/s ({result['num_prompts']} "
            f"requests): offered {_fmt(result['offered_rate'], '.3g')}, achieved "
            f"{_fmt(result['achieved_rate'], '.3g')} req/s ({_fmt(ratio, '.2f')}x), "
            f"P99 TTFT {_fmt(result['window_p99_ttft_ms'], '.0f')} ms, "
            f"TPOT {_fmt(result['window_p99_tpot_ms'], '.0f')} ms")
    if settings.criterion == "attainment":
        line += f", SLO attainment {_fmt(result['window_slo_attainment'], '.3f')}"
    if result["cancelled"]:
        line += f", {result['cancelled']} cancelled"
    if result["passed"]:
        return line + " -> pass"
    return line + f" -> miss ({'; '.join(result['miss_reasons'])})"


Measure = Callable[[float, int], Awaitable[dict]]  # (rate, step index) -> result dict


async def search_max_goodput(measure: Measure, settings: SearchSettings,
                             on_step: Callable[[dict], None] = lambda step: None,
                             clock: Callable[[], float] = time.monotonic) -> dict:
    """Run the bisection; `on_step` sees each step's result (with `passed`)
    as soon as it is measured, so a caller can save partial results."""
    low, high = settings.low, settings.high
    steps: list[dict] = []
    started = clock()
    last_step_s = 0.0
    while len(steps) < settings.max_steps and high / low > 1 + settings.resolution:
        if settings.budget_s is not None and clock() - started + last_step_s > settings.budget_s:
            break  # the next step would likely end past the budget
        rate = math.sqrt(low * high)
        step_started = clock()
        result = dict(await measure(rate, len(steps)))
        last_step_s = clock() - step_started
        result["miss_reasons"] = miss_reasons(result, settings)
        result["passed"] = not result["miss_reasons"]
        steps.append(result)
        on_step(result)
        if result["passed"]:
            low = rate
        else:
            high = rate
    return summarize_search(steps, settings, (low, high))


def sustained_rate(step: dict) -> float | None:
    rates = [step.get("offered_rate"), step.get("achieved_rate")]
    return None if None in rates else min(rates)


def summarize_search(steps: list[dict], settings: SearchSettings, bracket: tuple[float, float]) -> dict:
    """The search's JSON: settings, every step, and the maximum found."""
    passing = [s for s in steps if s["passed"]]
    best = max(passing, key=lambda s: s["request_rate"]) if passing else None
    return {
        "search": asdict(settings),
        "bracket": list(bracket),
        "max_request_rate": best["request_rate"] if best else None,
        "max_request_goodput": best["request_goodput"] if best else None,
        "max_request_throughput": best["request_throughput"] if best else None,
        # The window figures of that step: what it offered and what the stack kept up with.
        "max_offered_rate": best["offered_rate"] if best else None,
        "max_achieved_rate": best["achieved_rate"] if best else None,
        # The sustained goodput: what that step both received and completed.
        # Achieved counts completions over a shifted window, so it can exceed
        # the arrivals by the edges' jitter; the lower of the two is the claim.
        "max_sustained_rate": sustained_rate(best) if best else None,
        # The answer sits at a bound the search never saw a miss or pass beyond.
        "at_bound": ("high" if best and bracket[1] == settings.high else
                     "low" if not best else None),
        "steps": steps,
    }
