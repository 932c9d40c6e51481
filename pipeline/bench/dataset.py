"""The `random-mm` workload: random text plus random-noise JPEG images (and,
for buckets of T > 1 frames, generated clips: clips.py), and the open-loop
arrival schedule.

Images are cheap to make: a few noise JPEGs per size bucket are encoded once
per process (PIXEL_POOL_SIZE), and every image sent is one of them with a
JPEG comment segment (COM, right after SOI) holding a nonce. The server
hashes bytes, so each nonce is a distinct cache key and a full encode, while
no request pays for a JPEG encode (about 10 ms each on a slow host, which
would delay a 30 s search step by seconds). A request keeps only the
image's recipe (NoiseImage); its data URL is built when it is sent, so a long
step does not hold hundreds of megabytes of base64 at once. With
--image-reuse, a reused image repeats the nonce of an earlier one and is
byte-identical to it.

Prompt length is counted in words drawn from a list of common English words,
each of which most BPE tokenizers encode as one token, so `--random-input-len`
is a text-token estimate (~1 token per word). The server-reported prompt
tokens (text, image and chat-template tokens) are what the results report.
"""

from __future__ import annotations

import ast
import base64
import functools
import io
import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from pipeline.bench.clips import CLIP_POOL_SIZE, GeneratedClip
from pipeline.prompt_words import WORDS

# Images drawn from the shared pool come from this many distinct images per
# size bucket: small enough that reuse produces repeated hashes quickly.
POOL_SIZE_PER_BUCKET = 4
# Noise pictures encoded per size bucket, whose pixels every image reuses.
PIXEL_POOL_SIZE = 4
JPEG_URL_PREFIX = "data:image/jpeg;base64,"
SOI, COM = b"\xff\xd8", b"\xff\xfe"

Bucket = tuple[int, int, int]


@dataclass(frozen=True)
class RandomMMConfig:
    num_prompts: int
    input_len: int
    output_len: int
    range_ratio: float
    base_items: int
    items_range_ratio: float
    buckets: dict[Bucket, float]
    image_reuse: float
    text_only_fraction: float = 0.0   # requests sent without images (mixed text and image load)
    prefix_len: int = 0               # words every prompt starts with, the same for all (vLLM's --random-prefix-len)

    def __post_init__(self) -> None:
        checks = [
            (self.num_prompts >= 1, "--num-prompts must be >= 1"),
            (self.input_len >= 1, "--random-input-len must be >= 1"),
            (self.prefix_len >= 0, "--random-prefix-len must be >= 0"),
            (self.output_len >= 1, "--random-output-len must be >= 1"),
            (0 <= self.range_ratio < 1, "--random-range-ratio must be in [0, 1)"),
            (self.base_items >= 0, "--random-mm-base-items-per-request must be >= 0"),
            (0 <= self.items_range_ratio <= 1, "--random-mm-num-mm-items-range-ratio must be in [0, 1]"),
            (0 <= self.image_reuse <= 1, "--image-reuse must be in [0, 1]"),
            (0 <= self.text_only_fraction <= 1, "--text-only-fraction must be in [0, 1]"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


def _encode_noise_jpeg(height: int, width: int, index: int) -> bytes:
    pixels = np.random.default_rng((height, width, index)).integers(0, 256, size=(height, width, 3),
                                                                     dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=85)
    return buffer.getvalue()


@functools.lru_cache(maxsize=None)
def pooled_jpeg_tail(height: int, width: int, index: int) -> str:
    """base64 of pool JPEG `index` without its SOI marker, encoded once per process."""
    jpeg = _encode_noise_jpeg(height, width, index)
    if not jpeg.startswith(SOI):
        raise RuntimeError("Pillow wrote a JPEG without an SOI marker")
    return base64.b64encode(jpeg[len(SOI):]).decode("ascii")


@dataclass(frozen=True)
class NoiseImage:
    """An image's recipe: pool pixels plus the nonce that makes its bytes
    unique (two images with the same recipe are byte-identical)."""

    height: int
    width: int
    pool_index: int
    nonce: str

    def content_part(self) -> dict:
        return {"type": "image_url", "image_url": {"url": self.data_url()}}

    def data_url(self) -> str:
        payload = self.nonce.encode("ascii")
        # SOI, marker and length take 6 bytes; a payload of a multiple of 3
        # keeps the head a whole number of base64 groups, so the cached
        # base64 of the pool JPEG's rest joins it as is.
        payload += b" " * (-len(payload) % 3)
        head = SOI + COM + (len(payload) + 2).to_bytes(2, "big") + payload
        tail = pooled_jpeg_tail(self.height, self.width, self.pool_index)
        return JPEG_URL_PREFIX + base64.b64encode(head).decode("ascii") + tail


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    prompt_len: int
    output_len: int
    images: tuple[NoiseImage | GeneratedClip, ...]   # images and (T > 1 buckets) clips

    @property
    def image_urls(self) -> tuple[str, ...]:
        """The images as data URLs, built on each call (see the module docstring)."""
        return tuple(image.data_url() for image in self.images if isinstance(image, NoiseImage))

    def content_parts(self) -> list[dict]:
        """Each item's OpenAI content part, built on each call."""
        return [item.content_part() for item in self.images]


def parse_bucket_config(text: str) -> dict[Bucket, float]:
    """Parse `{(H, W, T): p, ...}` (T = 1 an image, T > 1 a clip of T frames);
    probabilities are normalized to sum to 1."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise ValueError(f"--random-mm-bucket-config is not a Python literal dict: {text!r}") from None
    if not isinstance(value, dict) or not value:
        raise ValueError("--random-mm-bucket-config must be a non-empty dict {(H, W, T): probability}")
    for key, prob in value.items():
        if not (isinstance(key, tuple) and len(key) == 3 and all(isinstance(k, int) and k >= 1 for k in key)):
            raise ValueError(f"--random-mm-bucket-config key {key!r} must be (H, W, T) with positive ints")
        if not isinstance(prob, (int, float)) or not prob >= 0:
            raise ValueError(f"--random-mm-bucket-config probability for {key!r} must be a number >= 0")
    total = float(sum(value.values()))
    if total <= 0:
        raise ValueError("--random-mm-bucket-config probabilities sum to 0")
    return {key: prob / total for key, prob in value.items()}


def _uniform_int(rng: np.random.Generator, base: int, ratio: float, minimum: int) -> int:
    low = max(minimum, math.floor(base * (1 - ratio)))
    high = max(low, math.ceil(base * (1 + ratio)))
    return int(rng.integers(low, high + 1))


class _ImageSource:
    """Unique noise images, or with probability `reuse` one from a small pool
    of POOL_SIZE_PER_BUCKET images per bucket (byte-identical on each draw)."""

    def __init__(self, cfg: RandomMMConfig, rng: np.random.Generator):
        self.rng = rng
        self.reuse = cfg.image_reuse
        self.buckets = list(cfg.buckets)
        self.probs = np.array([cfg.buckets[b] for b in self.buckets])
        # Drawn from the run's seeded stream: another run (another seed)
        # sends other bytes and does not hit caches an earlier run warmed.
        self.run_token = int(rng.integers(2 ** 62))

    def draw(self, request_index: int, item_index: int) -> NoiseImage | GeneratedClip:
        bucket = self.buckets[int(self.rng.choice(len(self.buckets), p=self.probs))]
        height, width, frames = bucket
        if frames > 1:
            return self._clip(height, width, frames, request_index, item_index)
        if self.rng.random() >= self.reuse:
            pixels = int(self.rng.integers(PIXEL_POOL_SIZE))
            return NoiseImage(height, width, pixels, f"epd-bench {self.run_token} {request_index} {item_index}")
        slot = int(self.rng.integers(POOL_SIZE_PER_BUCKET))
        return NoiseImage(height, width, slot % PIXEL_POOL_SIZE,
                          f"epd-bench {self.run_token} reuse {height}x{width} {slot}")


    def _clip(self, height: int, width: int, frames: int, request_index: int, item_index: int) -> GeneratedClip:
        if self.rng.random() >= self.reuse:
            pool = int(self.rng.integers(CLIP_POOL_SIZE))
            return GeneratedClip(height, width, frames, pool, f"epd-bench {self.run_token} {request_index} {item_index}")
        slot = int(self.rng.integers(POOL_SIZE_PER_BUCKET))
        return GeneratedClip(height, width, frames, slot % CLIP_POOL_SIZE,
                             f"epd-bench {self.run_token} reuse {height}x{width}x{frames} {slot}")


def sample_requests(cfg: RandomMMConfig, rng: np.random.Generator) -> list[BenchRequest]:
    images = _ImageSource(cfg, rng)
    # From a stream of its own: the run's draws stay as they are without it, and
    # runs of any seed share it, as a deployment's system prompt is shared.
    drawn_prefix = np.random.default_rng(cfg.prefix_len).choice(len(WORDS), size=cfg.prefix_len)
    prefix = "".join(f"{WORDS[i]} " for i in drawn_prefix)
    requests = []
    for index in range(cfg.num_prompts):
        prompt_len = _uniform_int(rng, cfg.input_len, cfg.range_ratio, 1)
        output_len = _uniform_int(rng, cfg.output_len, cfg.range_ratio, 1)
        num_images = _uniform_int(rng, cfg.base_items, cfg.items_range_ratio, 0)
        # Drawn only when asked for, so other runs keep their seeded streams.
        if cfg.text_only_fraction and rng.random() < cfg.text_only_fraction:
            num_images = 0
        words = rng.choice(len(WORDS), size=prompt_len)
        prompt = prefix + " ".join(WORDS[i] for i in words)
        drawn = tuple(images.draw(index, item) for item in range(num_images))
        requests.append(BenchRequest(prompt, cfg.prefix_len + prompt_len, output_len, drawn))
    return requests


def _check_rate(rate: float, burstiness: float) -> None:
    if not rate > 0:
        raise ValueError("--request-rate must be > 0")
    if not burstiness > 0:
        raise ValueError("--burstiness must be > 0")


def arrival_offsets(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Send times in seconds after the start, first request at 0.

    Inter-arrival gaps are gamma(shape=burstiness, mean=1/rate), as in vLLM:
    burstiness 1 is a Poisson process, lower is burstier. rate=inf sends all
    at once.
    """
    _check_rate(rate, burstiness)
    if math.isinf(rate):
        return np.zeros(n)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def arrivals_within(span_s: float, rate: float, burstiness: float, rng: np.random.Generator,
                    least: int, most: int | None = None, warmup_s: float = 0.0) -> np.ndarray:
    """Send times of a search step's arrivals in [0, span_s]: round(rate * L)
    of them in each part of the step, the warm-up [0, warmup_s) and the
    measurement window [warmup_s, span_s] (L: the part's length), but at least
    `least` and at most `most` in all. Each part's first arrival is at its
    start and the window's last at its end, so the window offers its rate
    to within rounding.

    A step is a length of time, not a count: a fixed count of arrivals at 1.7
    req/s can end 10 s early or late in a 40 s step. Nor is the count left to
    chance: Poisson counts made a step's offered rate its seed's luck (with
    the default seed, a search's first three steps offered 0.95x, 1.04x and
    1.13x their nominal rates, the same at every rate), so a search judged
    its later, higher steps at well above the rates it named. Within a part
    the gaps are gamma(shape=burstiness) draws scaled to fill it, so the
    arrivals keep their burstiness.
    """
    if not span_s > 0 or math.isinf(rate):
        raise ValueError("a span of arrivals needs span_s > 0 and a finite rate")
    _check_rate(rate, burstiness)
    cuts = [0.0, warmup_s, span_s] if 0 < warmup_s < span_s else [0.0, span_s]
    parts = []
    for begin, end in zip(cuts, cuts[1:]):
        count = max(1, round(rate * (end - begin)))
        # count - 1 gaps between the arrivals; the warm-up's last is a gap
        # before the window's first, the window's last arrival lands at its end.
        last_part = end == span_s
        gaps = rng.gamma(shape=burstiness, size=count - 1 if last_part else count)
        steps = np.concatenate([[0.0], np.cumsum(gaps)])[:count]
        parts.append(np.minimum(begin + (end - begin) * steps / (gaps.sum() if gaps.size else 1.0), end))
    drawn = np.concatenate(parts)
    if len(drawn) < least:  # a slow rate: `least` arrivals at it, past the span
        drawn = arrival_offsets(least, rate, burstiness, rng)
    return drawn if most is None else drawn[:most]
