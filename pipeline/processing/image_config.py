"""Settings of the smart-resize patch image processor, read from a checkpoint.

The reference is the smart-resize patch image processor of these checkpoints
(transformers' PIL image processor for them); the model families differ only
in its settings (patch size, normalisation, pixel bounds), never in the
algorithm. The settings live in `preprocessor_config.json` or, in a folder
that transformers 5 saved as a whole processor, under the `image_processor`
key of `processor_config.json`; both are read as the reference reads them.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from PIL import Image

from pipeline.arg_parser import json_object

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
PREPROCESSOR_FILE = "preprocessor_config.json"
PROCESSOR_FILE = "processor_config.json"
CHANNELS = 3
# Bumped whenever the pixels this code produces change for the same settings,
# so content hashes salted with settings_key() stop matching stale entries.
ALGORITHM_VERSION = "smart-resize-patches/v1"
# Steps the reference lets a checkpoint switch off or change; this pipeline
# implements only the defaults every such checkpoint ships (resample 3 is
# Pillow's BICUBIC), so any other value is refused rather than silently ignored.
FIXED_STEPS = (
    ("do_resize", True), ("do_rescale", True), ("do_normalize", True),
    ("do_convert_rgb", True), ("resample", 3),
)
# Settings copied as they are from the JSON; the size keys have their own rules.
_PLAIN_SETTINGS = ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std",
                   "rescale_factor")


def _check_int(name: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")


def _check_number(name: str, value: Any, positive: bool) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return float(value)


def _channel_values(name: str, value: Any, positive: bool) -> tuple[float, ...]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = [value] * CHANNELS  # the reference also accepts one number for all channels
    if not isinstance(value, (list, tuple)) or len(value) != CHANNELS:
        raise ValueError(f"{name} must be a list of {CHANNELS} numbers (one per RGB channel), got {value!r}")
    return tuple(_check_number(f"{name}[{i}]", v, positive) for i, v in enumerate(value))


def _pillow_pixel_limit() -> int | None:
    """Pillow refuses, inside Image.open, images over twice its MAX_IMAGE_PIXELS;
    a larger max_image_pixels could never take effect."""
    return None if Image.MAX_IMAGE_PIXELS is None else 2 * int(Image.MAX_IMAGE_PIXELS)


@dataclass(frozen=True)
class ImageProcessorConfig:
    """Settings of the smart-resize patch image processor; validated on construction.

    min_pixels/max_pixels bound the resized image's area; max_image_pixels
    bounds the decoded source image (a decompression-bomb guard, checked from
    the header before any pixel is decoded). The defaults are the reference
    class's own (14-pixel patches, CLIP normalisation); checkpoints with other
    settings say so in their processor config.
    """

    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    image_mean: tuple[float, ...] = OPENAI_CLIP_MEAN
    image_std: tuple[float, ...] = OPENAI_CLIP_STD
    rescale_factor: float = 1 / 255
    max_image_pixels: int = 64_000_000

    def __post_init__(self) -> None:
        _check_int("patch_size", self.patch_size, 1, 1024)
        _check_int("temporal_patch_size", self.temporal_patch_size, 1, 64)
        _check_int("merge_size", self.merge_size, 1, 64)
        _check_int("min_pixels", self.min_pixels, 1, 2**40)
        # smart_resize never goes below factor x factor, so a smaller cap is unreachable.
        _check_int("max_pixels", self.max_pixels, self.factor**2, 2**40)
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels ({self.min_pixels}) must be <= max_pixels ({self.max_pixels})")
        object.__setattr__(self, "image_mean", _channel_values("image_mean", self.image_mean, False))
        object.__setattr__(self, "image_std", _channel_values("image_std", self.image_std, True))
        object.__setattr__(self, "rescale_factor",
                           _check_number("rescale_factor", self.rescale_factor, True))
        limit = _pillow_pixel_limit()
        _check_int("max_image_pixels", self.max_image_pixels, 1, limit if limit is not None else 2**62)

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this: one merged token covers factor x factor pixels."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """Length of one row of pixel_values."""
        return CHANNELS * self.temporal_patch_size * self.patch_size * self.patch_size

    def settings_key(self) -> str:
        """A stable string of every setting, to salt content hashes of processed images."""
        parts = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)]
        return ALGORITHM_VERSION + "|" + "|".join(parts)

    @classmethod
    def from_checkpoint(cls, model_dir: Path, overrides: Mapping[str, int] | None = None) -> ImageProcessorConfig:
        """The checkpoint folder's settings; the defaults when it has none.

        Both size styles are accepted: legacy top-level `min_pixels`/`max_pixels`
        and `size: {shortest_edge, longest_edge}`. As in the reference processor,
        the legacy keys win when both are present. `overrides`: the server's
        own (vLLM's --mm-processor-kwargs; SERVER_OVERRIDES), over the folder's.
        """
        found = read_settings(Path(model_dir))
        if found is None:
            return cls(**(overrides or {}))
        raw, origin = found
        for key, expected in FIXED_STEPS:
            if key in raw and raw[key] != expected:
                raise ValueError(f"{origin}: {key}={raw[key]!r} is not supported; only {expected!r} is")
        kwargs: dict[str, Any] = _size_from_json(raw, origin)
        for name in _PLAIN_SETTINGS:
            if raw.get(name) is not None:
                kwargs[name] = raw[name]
        return cls(**{**kwargs, **(overrides or {})})


def _read_json_object(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"{path} is not a JSON object")
    return raw


def read_settings(model_dir: Path) -> tuple[dict[str, Any], str] | None:
    """(image processor settings, where they came from), or None when the folder has none.

    As in transformers, the `image_processor` entry of processor_config.json
    wins over preprocessor_config.json: a folder a transformers 5 processor
    saved has only the former, and reading only the latter would silently
    give the defaults, whose patch size and normalisation may be wrong.
    """
    combined = model_dir / PROCESSOR_FILE
    if combined.is_file():
        nested = _read_json_object(combined).get("image_processor")
        if nested is not None:
            if not isinstance(nested, dict):
                raise ValueError(f"{combined}: image_processor must be an object, got {nested!r}")
            return nested, f"{combined} (image_processor)"
    path = model_dir / PREPROCESSOR_FILE
    if path.is_file():
        return _read_json_object(path), str(path)
    return None


def _size_from_json(raw: dict[str, Any], origin: str) -> dict[str, Any]:
    """min_pixels/max_pixels from either key style; empty when neither is given."""
    out: dict[str, Any] = {}
    size = raw.get("size")
    if size is not None:
        if not isinstance(size, dict):
            raise ValueError(f"{origin}: size must be an object with shortest_edge and longest_edge, "
                             f"got {size!r}")
        if "shortest_edge" in size:
            out["min_pixels"] = size["shortest_edge"]
        if "longest_edge" in size:
            out["max_pixels"] = size["longest_edge"]
    for legacy in ("min_pixels", "max_pixels"):
        if raw.get(legacy) is not None:
            out[legacy] = raw[legacy]
    if size is not None and len(out) < 2:
        raise ValueError(f"{origin}: size must contain shortest_edge and longest_edge "
                         f"(or give min_pixels and max_pixels), got {size!r}")
    return out


# The image processor settings a server may set for every request
# (--mm-processor-kwargs): the resized area's bounds, which set how many
# tokens an image costs.
SERVER_OVERRIDES = ("min_pixels", "max_pixels")


def mm_processor_kwargs_arg(text: str) -> dict[str, int]:
    """--mm-processor-kwargs's JSON, e.g. '{"max_pixels": 1003520}'; an
    argparse error naming what is wrong."""
    value = json_object(text, '{"max_pixels": 1003520}')
    if unknown := sorted(set(value) - set(SERVER_OVERRIDES)):
        raise argparse.ArgumentTypeError(f"{', '.join(unknown)}: the server sets only {', '.join(SERVER_OVERRIDES)}")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in value.values()):
        raise argparse.ArgumentTypeError(f"{text}: the values are pixel counts (integers)")
    try:
        ImageProcessorConfig(**value)   # the bounds' own checks (at least one token, min <= max)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value


def add_mm_processor_kwargs_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mm-processor-kwargs", type=mm_processor_kwargs_arg, metavar="JSON",
                   help="the image processor's bounds for every request, as vLLM's flag: "
                        "'{\"max_pixels\": N, \"min_pixels\": M}' over the checkpoint's; the proxy, the encoders "
                        "and the generators must be given the same (epd-launch passes it to all)")
