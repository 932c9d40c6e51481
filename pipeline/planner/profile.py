"""A box's profile: what `bin/epd-plan --profile-out` measured, as JSON.

The capacity planner (capacity.py) predicts from these numbers alone, so the
format is the contract between measuring and planning (README: "Capacity
planner"). All times are seconds of wall time with the GPU drained, medians
of repeats. "beside" is the same work while another process keeps the same
GPU busy with the other kind of work (under MPS when `mps` is true): a
generator running mixed prefill/decode steps beside vision forwards, a
vision loop beside the generator's steps; "beside_half" the same with that
process busy half the time (it idles as long as it worked).

Decoded with msgspec against these Structs, so a malformed file is refused
with the field's path in the message, never half-read.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import msgspec

FORMAT = "epd-profile/1"
LOAD_VISION_BATCH = 8  # images per forward of the profile's vision load (planner/load.py)


Count = Annotated[int, msgspec.Meta(ge=1)]


class VisionPoint(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    width: Count
    height: Count
    tokens: Count  # visual tokens per image the language model sees (after merging)
    batch: Count  # images per forward
    alone_s: float  # one forward of the whole batch
    beside_s: float | None = None
    beside_half_s: float | None = None  # the other side busy half the time


class DecodePoint(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    batch: Count  # sequences decoding in one step
    alone_s: float  # one decode step
    beside_s: float | None = None
    beside_half_s: float | None = None


class PrefillPoint(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    tokens: Count  # prompt tokens in one prefill-only step
    alone_s: float
    beside_s: float | None = None
    beside_half_s: float | None = None


class EngineLimits(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    max_num_batched_tokens: int  # a step's token budget (prefill chunks + decodes)
    max_num_seqs: int  # sequences per step
    encoder_max_batch_tokens: int  # visual tokens per encoder forward
    local_encode_tokens: int  # aggregated mode: visual tokens a generator encodes per step


class ImageGeometry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The model's image processor settings: visual tokens of any image size."""

    patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int


class Profile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    format: str
    model_id: str
    device_name: str  # torch's name of the GPU ("cpu" for a CPU profile)
    gpu_count: int
    dtype: str
    mps: bool  # the "beside" figures were measured under MPS
    vision_graphs: int  # the vision forwards' --vision-graphs (0: eager)
    limits: EngineLimits
    image: ImageGeometry
    vision: list[VisionPoint]
    decode: list[DecodePoint]
    prefill: list[PrefillPoint]
    created: str = ""
    notes: str = ""
    # Prompt tokens of each sequence in the decode timings (the planner scales
    # their batch-dependent part, the KV reads, to the served context). Files
    # written before this field was measured with 1024.
    decode_context_len: Count = 1024

    def __post_init__(self) -> None:
        if self.format != FORMAT:
            raise msgspec.ValidationError(f"format must be {FORMAT!r} (got {self.format!r})")
        for name in ("vision", "decode", "prefill"):
            if not getattr(self, name):
                raise msgspec.ValidationError(f"`{name}` must hold at least one measurement")
        keys = {"vision": [(p.width, p.height, p.batch) for p in self.vision],
                "decode": [p.batch for p in self.decode], "prefill": [p.tokens for p in self.prefill]}
        for name, values in keys.items():
            if len(set(values)) != len(values):
                raise msgspec.ValidationError(f"`{name}` measures one point twice")
        for point in [*self.vision, *self.decode, *self.prefill]:
            times = [t for t in (point.alone_s, point.beside_s, point.beside_half_s) if t is not None]
            if not all(t > 0 for t in times):
                raise msgspec.ValidationError(f"every time must be > 0 seconds (got {point})")


class ProfileError(ValueError):
    """A profile file that cannot be used; one line naming the file and why."""


def load_profile(path: Path) -> Profile:
    try:
        return msgspec.json.decode(Path(path).read_bytes(), type=Profile)
    except OSError as exc:
        raise ProfileError(f"{path}: {exc.strerror or exc}") from None
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProfileError(f"{path}: not an EPD profile: {exc}") from None


def save_profile(profile: Profile, path: Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgspec.json.format(msgspec.json.encode(profile), indent=2) + b"\n")


# ---- reading the curves -------------------------------------------------------

def interpolate(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear y(x) through (x, y) points sorted by x (a time by
    its amount of work). Beyond the ends, the nearest segment's line, held
    between the end point's time and that time scaled by the work: less
    work than the first point takes no longer than it and no less than its
    share of it, more work than the last no less than it and no more than
    in proportion. A profile timed on a busy box can have a bigger batch
    measured faster than a smaller one; the bare line then fell to zero
    past the end, and the planner divided by it. One point: y
    proportional to x through the origin."""
    if len(points) == 1:
        x0, y0 = points[0]
        return y0 * x / x0
    xs = [p[0] for p in points]
    i = min(max(bisect.bisect_left(xs, x), 1), len(points) - 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    line = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    if xs[0] <= x <= xs[-1]:
        return max(0.0, line)
    end_x, end_y = points[0] if x < xs[0] else points[-1]
    low, high = sorted((end_y, end_y * x / end_x))
    return min(max(line, low), high)


def _time(point, share: float) -> float:
    """The point's time while the other kind of work keeps the GPU busy
    `share` of the time: alone at 0, beside at 1, and between them through
    the half-duty figure where one was measured (interference is not linear
    in the other side's duty: serving rarely runs it back to back)."""
    if point.beside_s is None or share <= 0:
        return point.alone_s
    knots = [(0.0, point.alone_s), (1.0, point.beside_s)]
    if point.beside_half_s is not None:
        knots.insert(1, (0.5, point.beside_half_s))
    return interpolate(knots, min(1.0, share))


def decode_curve(profile: Profile, share: float = 0.0) -> Callable[[float], float]:
    """Seconds of one decode step by its batch, the other side busy `share`
    of the time; never below the cheapest step measured (a noisy curve that
    falls must not reach zero). The points are read once: the planner
    reads a curve thousands of times a plan."""
    points = sorted((p.batch, _time(p, share)) for p in profile.decode)
    if len(points) == 1:
        only = points[0][1]
        return lambda batch: only
    cheapest = min(y for _, y in points)
    return lambda batch: max(cheapest, interpolate(points, max(1.0, batch)))


def decode_step_s(profile: Profile, batch: float, share: float = 0.0) -> float:
    """One decode step of `batch` sequences (decode_curve)."""
    return decode_curve(profile, share)(batch)


def prefill_line(profile: Profile, share: float = 0.0) -> tuple[float, float]:
    """(seconds a step, seconds a token): the line through the two largest
    prefill steps measured, the ones chunked prefill runs near under load;
    its intercept is what a step pays whatever its chunk (the weight reads).
    One point: a line through the origin. Never a negative part: a noisy
    pair that falls keeps the larger point's mean cost a token."""
    points = sorted((p.tokens, _time(p, share)) for p in profile.prefill)[-2:]
    if len(points) == 1:
        return 0.0, points[0][1] / points[0][0]
    (x0, y0), (x1, y1) = points
    per_token = (y1 - y0) / (x1 - x0)
    intercept = y1 - per_token * x1
    if per_token <= 0 or intercept < 0:
        return 0.0, y1 / x1
    return intercept, per_token


def vision_curve(profile: Profile, tokens: int, share: float = 0.0) -> Callable[[float], float]:
    """Seconds of one vision forward by its batch of images of `tokens`
    visual tokens each, the other side busy `share` of the time.

    Measured at a few image sizes and batches. Forward time is taken as a
    function of the batch's visual tokens (images x tokens): that is what
    the tower's matmuls scale with; a fixed per-forward cost (the launches
    of an eager forward) shows as the curve's intercept."""
    points = sorted({(p.tokens * p.batch, _time(p, share)) for p in profile.vision})
    merged: dict[float, float] = {}
    for x, y in points:  # two sizes at one token count: keep their mean
        merged[x] = (merged[x] + y) / 2 if x in merged else y
    curve = sorted(merged.items())
    return lambda batch: interpolate(curve, max(1.0, batch) * tokens)


def vision_batch_s(profile: Profile, tokens: int, batch: float, share: float = 0.0) -> float:
    """One vision forward of `batch` images of `tokens` visual tokens each (vision_curve)."""
    return vision_curve(profile, tokens, share)(batch)


def vision_load_duty(profile: Profile, pressure: float) -> float:
    """The duty of the profile's vision load that presses on a generator as
    hard as encoders doing `pressure` seconds of vision work (timed alone)
    each second. The generator's figures "beside" were timed next to a loop
    of LOAD_VISION_BATCH-image forwards: each of them did alone/beside of
    its wall time's work (its forwards slowed beside the generator), so
    duty 1 is that much work a second. An encoder's busy share is no
    measure of the same thing: a small forward waits out much of its time
    beside the generator (a 1-image forward took 3.8x its alone time, an
    8-image one 1.6x; session 15's profile), pressing less than it is busy."""
    tokens = profile.vision[0].tokens   # the load ran at the first size measured (measure.py)
    alone = vision_batch_s(profile, tokens, LOAD_VISION_BATCH)
    beside = vision_batch_s(profile, tokens, LOAD_VISION_BATCH, share=1.0)
    return min(1.0, pressure * beside / alone)


def image_tokens(profile: Profile, width: int, height: int) -> int:
    """Visual tokens of a width x height image for the profiled model."""
    from pipeline.processing.image import ImageProcessorConfig, num_visual_tokens

    g = profile.image
    config = ImageProcessorConfig(patch_size=g.patch_size, merge_size=g.merge_size, min_pixels=g.min_pixels,
                                  max_pixels=g.max_pixels)
    return num_visual_tokens(height, width, config)


def has_beside(profile: Profile) -> bool:
    return any(p.beside_s is not None for p in [*profile.vision, *profile.decode, *profile.prefill])
