"""Bisect the request rate for the maximum goodput under latency SLOs.

A step runs the workload at one rate. With the `attainment` criterion (the
default) it passes when its SLO attainment (the fraction of sent requests
that completed and met every --goodput SLO; failed requests count as misses)
is at least the target; the default target 0.9 is the SLO attainment of
DistServe's goodput definition. With the `p99` criterion it passes when no
request failed and each SLO's metric has its P99 within the SLO: the
"goodput at P99 TTFT <= X and P99 TPOT <= Y" of vLLM's disaggregated-encoder
study and of our issue 6.

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

DEFAULT_TARGET = 0.9
CRITERIA = ("attainment", "p99")


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
        if self.budget_s is not None and not self.budget_s > 0:
            raise ValueError(f"--search-budget-s must be > 0 (got {self.budget_s:g})")


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


def step_passes(result: dict, settings: SearchSettings) -> bool:
    if settings.criterion == "p99":
        p99s = [result.get(f"p99_{metric}_ms") for metric in settings.slos]
        # A metric without samples (TPOT of one-token outputs) cannot miss its SLO.
        return result.get("failed", 0) == 0 and result.get("completed", 0) > 0 and all(
            value is None or value <= settings.slos[metric] for metric, value in zip(settings.slos, p99s))
    attainment = result.get("slo_attainment")
    return attainment is not None and attainment >= settings.target


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
        result["passed"] = step_passes(result, settings)
        steps.append(result)
        on_step(result)
        if result["passed"]:
            low = rate
        else:
            high = rate
    return summarize_search(steps, settings, (low, high))


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
        # The answer sits at a bound the search never saw a miss or pass beyond.
        "at_bound": ("high" if best and bracket[1] == settings.high else
                     "low" if not best else None),
        "steps": steps,
    }
