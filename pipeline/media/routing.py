"""Which decoder each image of a batch goes to, for the GPU backends.

Complete grey/YCbCr JPEGs (see probe.py) go to the GPU decoder in one batched
call. The rest, and any JPEG the GPU decoder fails on, go to the reference
Pillow decoder: it composites alpha as the reference does, and for a corrupt
file it raises the ImageDecodeError that names what is wrong. So a file is
refused only when the reference would refuse it too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

import numpy as np

from pipeline.media.pillow_backend import decode_rgb
from pipeline.media.probe import ImageHeader
from pipeline.processing.image import ImageDecodeError, ImageProcessorConfig

logger = logging.getLogger(__name__)

T = TypeVar("T")


def decode_routed(blobs: Sequence[bytes], headers: dict[int, ImageHeader], slots: list[Any],
                  cfg: ImageProcessorConfig, *, gpu_decode: Callable[[list[bytes]], Sequence[T]],
                  from_pillow: Callable[[np.ndarray], T], label: str,
                  cpu_map: Callable[..., Iterable[Any]] = map) -> dict[int, T]:
    """index -> decoded image for every index in `headers`, except those the
    Pillow decoder refuses: their ImageDecodeError is put in `slots` instead.

    gpu_decode: decodes a list of blobs in one call, raising RuntimeError when
    any fails. from_pillow: turns Pillow's HWC uint8 RGB array into the same
    image type. label names the GPU decoder in log lines. cpu_map runs the
    Pillow decodes (a thread pool's map spreads them over threads).
    """
    jpegs = [i for i, header in headers.items() if header.gpu_jpeg]
    decoded = _isolate_failures(gpu_decode, [blobs[i] for i in jpegs], label)
    images: dict[int, Any] = dict(zip(jpegs, decoded))
    rest = [i for i in headers if images.get(i) is None]
    for i in rest:
        if i in images:
            logger.info("%s could not decode image %d of the batch; trying the Pillow decoder", label, i)
    for i, rgb in zip(rest, cpu_map(_decode_rgb_or_error, [blobs[i] for i in rest], [cfg] * len(rest))):
        if isinstance(rgb, ImageDecodeError):
            slots[i] = rgb
            images.pop(i, None)
        else:
            images[i] = from_pillow(rgb)
    return images


def _decode_rgb_or_error(blob: bytes, cfg: ImageProcessorConfig) -> np.ndarray | ImageDecodeError:
    try:
        return decode_rgb(blob, cfg)
    except ImageDecodeError as exc:
        return exc


def _isolate_failures(run: Callable[[list[bytes]], Sequence[T]], blobs: list[bytes],
                      label: str) -> list[T | None]:
    """run(blobs), or, when that fails, run on each blob alone: None where it
    fails, so one bad file costs only itself (and one retry of the batch)."""
    if not blobs:
        return []
    try:
        return list(run(blobs))
    except RuntimeError as exc:
        if len(blobs) == 1:
            logger.debug("%s failed: %s", label, exc)
            return [None]
    decoded: list[T | None] = []
    for blob in blobs:
        try:
            decoded.append(run([blob])[0])
        except RuntimeError as exc:
            logger.debug("%s failed: %s", label, exc)
            decoded.append(None)
    return decoded
