"""The `random-mm` workload: random text plus random-noise JPEG images, and
the open-loop arrival schedule.

Prompt length is counted in words drawn from a list of common English words,
each of which most BPE tokenizers encode as one token, so `--random-input-len`
is a text-token estimate (~1 token per word). The server-reported prompt
tokens (text, image and chat-template tokens) are what the results report.
"""

from __future__ import annotations

import ast
import base64
import io
import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

WORDS = (
    "the of and to in is that it was for on are as with his they at be this have from "
    "or one had by word but not what all were we when your can said there use each which "
    "she do how their if will up other about out many then them these so some her would "
    "make like him into time has look two more write go see number no way could people my "
    "than first water been call who oil its now find long down day did get come made may part"
).split()

# Images drawn from the shared pool come from this many distinct images per
# size bucket: small enough that reuse produces repeated hashes quickly.
POOL_SIZE_PER_BUCKET = 4

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

    def __post_init__(self) -> None:
        checks = [
            (self.num_prompts >= 1, "--num-prompts must be >= 1"),
            (self.input_len >= 1, "--random-input-len must be >= 1"),
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


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    prompt_len: int
    output_len: int
    image_urls: tuple[str, ...]


def parse_bucket_config(text: str) -> dict[Bucket, float]:
    """Parse `{(H, W, 1): p, ...}`; probabilities are normalized to sum to 1."""
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        raise ValueError(f"--random-mm-bucket-config is not a Python literal dict: {text!r}") from None
    if not isinstance(value, dict) or not value:
        raise ValueError("--random-mm-bucket-config must be a non-empty dict {(H, W, 1): probability}")
    for key, prob in value.items():
        if not (isinstance(key, tuple) and len(key) == 3 and all(isinstance(k, int) and k >= 1 for k in key)):
            raise ValueError(f"--random-mm-bucket-config key {key!r} must be (H, W, 1) with positive ints")
        if key[2] != 1:
            raise ValueError(f"--random-mm-bucket-config key {key!r}: only images (T=1) are supported")
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


def _noise_jpeg_url(rng: np.random.Generator, height: int, width: int) -> str:
    pixels = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=85)
    return "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


class _ImageSource:
    """Fresh noise images, or with probability `reuse` one from a small pool."""

    def __init__(self, cfg: RandomMMConfig, rng: np.random.Generator):
        self.rng = rng
        self.reuse = cfg.image_reuse
        self.buckets = list(cfg.buckets)
        self.probs = np.array([cfg.buckets[b] for b in self.buckets])
        self.pool: dict[tuple[Bucket, int], str] = {}

    def draw(self) -> str:
        bucket = self.buckets[int(self.rng.choice(len(self.buckets), p=self.probs))]
        height, width, _ = bucket
        if self.rng.random() >= self.reuse:
            return _noise_jpeg_url(self.rng, height, width)
        key = (bucket, int(self.rng.integers(POOL_SIZE_PER_BUCKET)))
        if key not in self.pool:
            self.pool[key] = _noise_jpeg_url(self.rng, height, width)
        return self.pool[key]


def sample_requests(cfg: RandomMMConfig, rng: np.random.Generator) -> list[BenchRequest]:
    images = _ImageSource(cfg, rng)
    requests = []
    for _ in range(cfg.num_prompts):
        prompt_len = _uniform_int(rng, cfg.input_len, cfg.range_ratio, 1)
        output_len = _uniform_int(rng, cfg.output_len, cfg.range_ratio, 1)
        num_images = _uniform_int(rng, cfg.base_items, cfg.items_range_ratio, 0)
        # Drawn only when asked for, so other runs keep their seeded streams.
        if cfg.text_only_fraction and rng.random() < cfg.text_only_fraction:
            num_images = 0
        words = rng.choice(len(WORDS), size=prompt_len)
        prompt = " ".join(WORDS[i] for i in words)
        urls = tuple(images.draw() for _ in range(num_images))
        requests.append(BenchRequest(prompt, prompt_len, output_len, urls))
    return requests


def arrival_offsets(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Send times in seconds after the start, first request at 0.

    Inter-arrival gaps are gamma(shape=burstiness, mean=1/rate), as in vLLM:
    burstiness 1 is a Poisson process, lower is burstier. rate=inf sends all
    at once.
    """
    if not rate > 0:
        raise ValueError("--request-rate must be > 0")
    if not burstiness > 0:
        raise ValueError("--burstiness must be > 0")
    if math.isinf(rate):
        return np.zeros(n)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])
