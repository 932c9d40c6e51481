"""The reference backend: Pillow decode and resize on the CPU, bit-exact with
the smart-resize patch image processor of these checkpoints (transformers'
PIL image processor for them).

A batch is spread over a small thread pool: Pillow releases the GIL while it
decodes and resizes, and numpy's gather releases it too (batch of 16 640x640
JPEGs on a 2-core machine: 48 images/s with one thread, 117 with two).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
import torch

from pipeline.media.base import BackendUnavailableError, DecodedImage, MediaBackend
from pipeline.media.probe import check_blobs
from pipeline.processing.image import (
    ImageDecodeError,
    ImageProcessorConfig,
    check_source_size,
    open_image,
    preprocess_images,
)

# More threads than this buy little: the encoder process has other work
# (vision forward, I/O) and each thread holds a full decoded image.
DEFAULT_MAX_THREADS = 4

T = TypeVar("T")


def default_num_threads() -> int:
    return max(1, min(DEFAULT_MAX_THREADS, os.cpu_count() or 1))


def decode_rgb(data: bytes, cfg: ImageProcessorConfig) -> np.ndarray:
    """HWC uint8 RGB pixels by the reference decoder (alpha composited onto
    white); raises ImageDecodeError. open_image checks the header size first."""
    with open_image(data, cfg) as image:
        rgb = np.asarray(image)
    # Pillow hands numpy a read-only buffer; consumers (torch.from_numpy, DALI)
    # would warn or copy anyway, so copy once here.
    return rgb if rgb.flags.writeable else rgb.copy()


def unavailable_reason(device: torch.device) -> str | None:
    """Pillow runs anywhere; outputs are copied to `device` when it is not the CPU."""
    if device.type == "cuda" and not torch.cuda.is_available():
        return "torch sees no CUDA device to copy the outputs to"
    return None


def check_num_threads(num_threads: int | None) -> int:
    if num_threads is None:
        return default_num_threads()
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or not 1 <= num_threads <= 64:
        raise ValueError(f"num_threads must be an integer in [1, 64], got {num_threads!r}")
    return num_threads


class DecodePool:
    """Threads for CPU decoding, started on first use; one thread, or one item,
    runs in the caller's thread."""

    def __init__(self, num_threads: int | None = None) -> None:
        self.num_threads = check_num_threads(num_threads)
        self._pool: ThreadPoolExecutor | None = None

    def map(self, fn: Callable[..., T], *iterables: Iterable[Any]) -> list[T]:
        columns = [list(it) for it in iterables]
        if self.num_threads == 1 or len(columns[0]) < 2:
            return [fn(*args) for args in zip(*columns)]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.num_threads, thread_name_prefix="media-decode")
        return list(self._pool.map(fn, *columns))

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class PillowBackend(MediaBackend):
    """Decodes on the CPU; outputs are moved to `device` (a plain copy) when it
    is not the CPU. num_threads=1 decodes in the caller's thread."""

    def __init__(self, device: torch.device | str = "cpu", num_threads: int | None = None) -> None:
        device = torch.device(device)
        reason = unavailable_reason(device)
        if reason is not None:
            raise BackendUnavailableError(f"pillow backend on {device}: {reason}")
        self._device = device
        self._pool = DecodePool(num_threads)

    @property
    def name(self) -> str:
        return "pillow"

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def num_threads(self) -> int:
        return self._pool.num_threads

    def decode(self, blobs: list[bytes],
               cfg: ImageProcessorConfig) -> list[DecodedImage | ImageDecodeError]:
        check_blobs(blobs)
        results = self._pool.map(_decode_one, blobs, [cfg] * len(blobs))
        if self._device.type == "cpu":
            return results
        return [r if isinstance(r, ImageDecodeError) else
                DecodedImage(r.pixel_values.to(self._device), r.grid, r.source_size) for r in results]

    def close(self) -> None:
        self._pool.close()


def _decode_one(blob: bytes, cfg: ImageProcessorConfig) -> DecodedImage | ImageDecodeError:
    try:
        image = open_image(blob, cfg)
        grid = check_source_size(image.height, image.width, cfg)
    except ImageDecodeError as exc:
        return exc
    with image:
        pixel_values, _ = preprocess_images([image], cfg)
        return DecodedImage(pixel_values, grid, (image.height, image.width))
