"""The capacity arithmetic: a box's profile + a workload + a layout -> the
highest request rate it sustains within the SLOs, and which stage bounds it.

Pure functions of the numbers in a Profile (profile.py); no device is
touched. The model, per the reference design's capacity section
(R*I <= N_e/T_e, R <= N_pd*mu_p, R <= N_pd*mu_d), made concrete for
continuous batching:

- Requests spread evenly: each generator gets r = R/G requests/s, each
  encoder R*I/E images/s.
- An encoder is a greedy batch server: each forward takes what queued
  during the last one (a request's images arrive together; at most its
  token budget). With Poisson arrivals of lambda requests/s the mean batch
  after a forward of T seconds is I * (lambda*T + exp(-lambda*T)) (none
  queued: it waits for the next request), and the mean forward solves
  T = T(that batch); busy T / (T + exp(-lambda*T)/lambda). No solution, or
  more images than a batch at the token budget serves: it cannot keep up.
  (The fluid limit, lambda_images * T(b) = b, called it busy ~1 as soon as
  a batch outgrew one request; measured 0.67-0.90: docs/benchmarks.md,
  session 25.) T is read at the generator's busy share where its GPU also
  runs one (profile.py: alone at 0, beside at 1, the half-duty figure
  between), alone otherwise.
- A generator (generator_model.py) runs mixed steps of a prompt chunk
  that carry the decoding sequences, and decode-only steps in the time
  they leave; TPOT is the time between steps, the decode batch follows by
  Little's law, and a generator whose mixed steps cannot fit even at full
  chunks falls behind. In aggregated mode its mixed steps also run the
  vision forwards of their chunks' images. On a GPU with encoders its
  costs are read at the duty of the profile's vision load that does as
  much vision work a second as they do (their work timed alone), not at
  their busy share: beside a generator a small forward spends most of its
  time waiting for the GPU, and presses on it less than it is busy
  (session 26). Stages of one kind sharing a GPU split it.
- TTFT = the P99 wait for the generator's prompt throughput + the encode
  latency + the prompt's chunks.

The highest rate is found by bisection on these constraints; `bound` names
the one that fails just above it: encoder, generator (throughput), tpot,
ttft or max_num_seqs.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from pipeline.launch.placement import place_stages
from pipeline.planner.generator_model import GeneratorLoad, serve
from pipeline.planner.profile import Profile, vision_curve, vision_load_duty

LAYOUT_KINDS = ("aggregated", "colocated", "dedicated")
TEMPLATE_TOKENS = 20  # chat-template tokens around a user turn (about 20 in the templates served today)
RATE_CEILING = 1e5
MAX_FORWARD_S = 60.0  # a mean vision forward this long means the encoder fell behind


@dataclass(frozen=True)
class Workload:
    images: int  # per request
    image_tokens: int  # visual tokens per image
    input_len: int  # text tokens
    output_len: int
    slo_ttft_s: float = 2.0
    slo_tpot_s: float = 0.05

    def __post_init__(self) -> None:
        if self.images < 0 or self.input_len < 0 or self.image_tokens < 1 or self.output_len < 1:
            raise ValueError("a workload needs images >= 0, input_len >= 0, image_tokens >= 1, output_len >= 1")
        if not (self.slo_ttft_s > 0 and self.slo_tpot_s > 0):
            raise ValueError("SLOs must be > 0")

    @property
    def prompt_tokens(self) -> int:
        # Each image's run of placeholders sits between a start and an end token.
        return self.input_len + self.images * (self.image_tokens + 2) + TEMPLATE_TOKENS


@dataclass(frozen=True)
class Layout:
    encoders: int
    generators: int
    placement: str  # aggregated, colocated or dedicated
    gpus: int

    def __post_init__(self) -> None:
        if self.placement not in LAYOUT_KINDS:
            raise ValueError(f"placement must be one of {', '.join(LAYOUT_KINDS)}")
        if self.generators < 1 or self.gpus < 1 or self.encoders < 0:
            raise ValueError("a layout needs generators >= 1, gpus >= 1, encoders >= 0")
        if (self.placement == "aggregated") != (self.encoders == 0):
            raise ValueError("aggregated layouts, and only they, have no encoders")

    def stage_gpus(self) -> tuple[list[int], list[int]]:
        """(GPU of each encoder, GPU of each generator)."""
        gpus = tuple(range(self.gpus))
        placement = "dedicated" if self.placement == "aggregated" else self.placement
        devices = place_stages(self.encoders, self.generators, gpus, placement)
        return devices[:self.encoders], devices[self.encoders:]

    @property
    def name(self) -> str:
        if self.placement == "aggregated":
            return f"aggregated {self.generators}G on {self.gpus} GPU(s)"
        return f"{self.placement} {self.encoders}E+{self.generators}G on {self.gpus} GPU(s)"


@dataclass
class Evaluation:
    """One rate's verdict: `failed` names the first constraint it breaks."""

    rate: float
    failed: str | None = None
    detail: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Prediction:
    layout: Layout
    max_rate: float
    bound: str
    detail: dict

    def as_json(self) -> dict:
        return {**asdict(self.layout), "name": self.layout.name, "max_rate": round(self.max_rate, 3),
                "bound": self.bound, "at_max": self.detail}


def evaluate(profile: Profile, workload: Workload, layout: Layout, rate: float) -> Evaluation:
    """Whether `layout` sustains `rate` requests/s of `workload` within its SLOs."""
    encoder_gpus, generator_gpus = layout.stage_gpus()
    generator_busy = 1.0  # first pass: encoders beside a fully busy generator
    for _ in range(3):   # the two sides' busy shares depend on each other; 3 passes settle them
        encoders = [_encoder(profile, workload, layout, gpu, encoder_gpus, generator_gpus, rate, generator_busy)
                    for gpu in encoder_gpus]
        generators = [_generator(profile, workload, layout, gpu, encoder_gpus, generator_gpus, encoders, rate)
                      for gpu in generator_gpus]
        generator_busy = max(g.get("busy", 1.0) for g in generators)
    # Judged on the settled figures, the ones reported.
    result = Evaluation(rate, detail={"encoders": encoders, "generators": generators})
    if not all(e["stable"] for e in encoders):
        result.failed = "encoder"
        return result
    for generator in generators:
        if generator.get("failed"):
            result.failed = generator["failed"]
            break
    return result


def _encoder(profile: Profile, workload: Workload, layout: Layout, gpu: int, encoder_gpus: list[int],
             generator_gpus: list[int], rate: float, generator_busy: float) -> dict:
    images_per_s = rate * workload.images / layout.encoders
    if images_per_s == 0:
        return {"gpu": gpu, "busy": 0.0, "batch": 0.0, "latency_s": 0.0, "stable": True, "work": 0.0}
    crowd = encoder_gpus.count(gpu)  # encoders sharing a GPU split it
    beside = min(1.0, generator_busy) if gpu in generator_gpus else 0.0
    max_batch = float(max(1, profile.limits.encoder_max_batch_tokens // workload.image_tokens))
    group = min(max_batch, max(1, workload.images))   # a request's images arrive together
    requests_per_s = rate / layout.encoders

    curve = vision_curve(profile, workload.image_tokens, share=beside)
    alone = vision_curve(profile, workload.image_tokens)

    def forward_s(batch: float) -> float:
        return crowd * curve(batch)

    def batch_after(forward: float) -> float:
        """A greedy batch server's next batch: what queued during a forward,
        N ~ Poisson(lambda*T) requests; none, and it waits for the next one.
        Mean: group * E[max(1, N)] = group * (lambda*T + exp(-lambda*T))."""
        queued = requests_per_s * forward
        return min(max_batch, group * (queued + math.exp(-queued)))

    # The mean forward T solves T = T(batch_after(T)). While the encoder
    # keeps up, a forward grows more slowly than the images queuing behind
    # it, so there is one crossing (bisection); none below MAX_FORWARD_S:
    # the queue grows.
    low, high = forward_s(group), MAX_FORWARD_S
    if forward_s(batch_after(high)) > high:
        return {"gpu": gpu, "busy": 1.0, "batch": max_batch, "latency_s": math.inf, "stable": False,
                "work": images_per_s * alone(max_batch) / max_batch}
    for _ in range(64):   # 60 s / 2**64: far below any forward
        middle = (low + high) / 2
        low, high = (middle, high) if forward_s(batch_after(middle)) > middle else (low, middle)
    forward = high
    batch = batch_after(forward)
    # Uncapped, a batch of group * (lambda*T + exp(-lambda*T)) a cycle of
    # T + exp(-lambda*T)/lambda serves exactly the arrivals; at the token
    # budget's cap it may not.
    stable = images_per_s * forward <= batch * (1 + 1e-9)
    idle = math.exp(-requests_per_s * forward) / requests_per_s   # after a forward that found none queued
    busy = forward / (forward + idle) if stable else 1.0
    work = images_per_s * alone(batch) / batch   # seconds of vision work a second, timed alone
    # An image waits for the forward in progress (up to one), then its own.
    return {"gpu": gpu, "busy": busy, "batch": batch, "latency_s": forward * (1.0 + busy), "stable": stable,
            "work": work}


def _generator(profile: Profile, workload: Workload, layout: Layout, gpu: int, encoder_gpus: list[int],
               generator_gpus: list[int], encoders: list[dict], rate: float) -> dict:
    work = sum(e["work"] for e, g in zip(encoders, encoder_gpus) if g == gpu)
    load = GeneratorLoad(rate=rate / layout.generators, prompt_tokens=workload.prompt_tokens,
                         output_len=workload.output_len, images=workload.images,
                         image_tokens=workload.image_tokens, inline_vision=layout.placement == "aggregated",
                         crowd=generator_gpus.count(gpu), encoder_share=vision_load_duty(profile, work))
    out = {"gpu": gpu, **serve(profile, load)}
    if out.get("failed"):
        return out
    if out["step_s"] > workload.slo_tpot_s:
        return {**out, "failed": "tpot"}
    out["ttft_s"] += max((e["latency_s"] for e in encoders), default=0.0)
    if out["ttft_s"] > workload.slo_ttft_s:
        return {**out, "failed": "ttft"}
    return out


def predict(profile: Profile, workload: Workload, layout: Layout) -> Prediction:
    """The highest sustainable rate, to about 0.1%, by bisection."""
    low, high = 0.0, 1.0
    while evaluate(profile, workload, layout, high).failed is None:
        low, high = high, high * 2
        if high > RATE_CEILING:
            return Prediction(layout, math.inf, "none", {})
    while high - low > 1e-3 * max(high, 1e-9):
        middle = (low + high) / 2
        if evaluate(profile, workload, layout, middle).failed is None:
            low = middle
        else:
            high = middle
    bound = evaluate(profile, workload, layout, high).failed or "none"
    detail = _rounded(evaluate(profile, workload, layout, low).detail) if low > 0 else {}
    return Prediction(layout, low, bound, detail)


def candidate_layouts(gpus: int) -> list[Layout]:
    """Aggregated on every GPU; colocated with 1..N encoders beside N
    generators; dedicated with 1..N-1 encoder GPUs."""
    layouts = [Layout(0, gpus, "aggregated", gpus)]
    layouts += [Layout(e, gpus, "colocated", gpus) for e in range(1, gpus + 1)]
    layouts += [Layout(e, gpus - e, "dedicated", gpus) for e in range(1, gpus)]
    return layouts


def plan(profile: Profile, workload: Workload, layouts: list[Layout]) -> tuple[list[Prediction], Prediction]:
    """Every layout's prediction and the chosen one: the highest rate; within
    1% of it, the simplest (aggregated, then fewer encoders)."""
    predictions = [predict(profile, workload, layout) for layout in layouts]
    best = max(p.max_rate for p in predictions)
    close = [p for p in predictions if p.max_rate >= best * 0.99]
    chosen = min(close, key=lambda p: (p.layout.placement != "aggregated", p.layout.encoders, -p.max_rate))
    return predictions, chosen


def _rounded(value):
    if isinstance(value, float):
        return round(value, 5)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value
