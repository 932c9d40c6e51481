"""Qwen2-VL / Qwen2.5-VL image preprocessing: bytes -> RGB -> resized, normalised patches.

Bit-exact with the Pillow backend of the reference Hugging Face processor
(`Qwen2VLImageProcessorPil`): the same Pillow bicubic resize, the same float64
rescale then float32 normalise, the same patch order. The grid and the number
of visual tokens depend only on the source height and width, so a front end
can count tokens from the image header without decoding any pixels.
"""

from __future__ import annotations

import io
import json
import math
import numbers
import struct
import zlib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageFile, UnidentifiedImageError

OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
PREPROCESSOR_FILE = "preprocessor_config.json"
MAX_ASPECT_RATIO = 200
CHANNELS = 3
# Bumped whenever the pixels this module produces change for the same settings,
# so content hashes salted with settings_key() stop matching stale entries.
ALGORITHM_VERSION = "qwen2vl-image/v1"
# Formats a request may carry. Pillow can read more, but some plugins are a
# large attack surface (EPS even runs Ghostscript), so the rest are refused.
# JPEG's opener also yields multi-picture (MPO) files, as phone cameras write.
ALLOWED_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP")
# Steps the reference lets a checkpoint switch off or change; this pipeline
# implements only the Qwen defaults (resample 3 is Pillow's BICUBIC), so any
# other value is refused rather than silently ignored.
FIXED_STEPS = (
    ("do_resize", True), ("do_rescale", True), ("do_normalize", True),
    ("do_convert_rgb", True), ("resample", 3),
)
# What Pillow raises from a plugin or decoder fed corrupt data.
DECODER_ERRORS = (OSError, SyntaxError, ValueError, EOFError, struct.error, zlib.error)


# ---------------------------------------------------------------- config

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
    """Settings of the Qwen2-VL image processor; validated on construction.

    min_pixels/max_pixels bound the resized image's area; max_image_pixels
    bounds the decoded source image (a decompression-bomb guard, checked from
    the header before any pixel is decoded).
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
    def from_checkpoint(cls, model_dir: Path) -> ImageProcessorConfig:
        """Read `preprocessor_config.json` from a checkpoint folder; defaults when it is absent.

        Both size styles are accepted: legacy top-level `min_pixels`/`max_pixels`
        and `size: {shortest_edge, longest_edge}`. As in the reference processor,
        the legacy keys win when both are present.
        """
        path = Path(model_dir) / PREPROCESSOR_FILE
        if not path.is_file():
            return cls()
        try:
            raw = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read {path}: {exc}") from exc
        if not isinstance(raw, dict):
            raise ValueError(f"{path} is not a JSON object")
        for key, expected in FIXED_STEPS:
            if key in raw and raw[key] != expected:
                raise ValueError(f"{path}: {key}={raw[key]!r} is not supported; only {expected!r} is")
        kwargs: dict[str, Any] = _size_from_json(raw, path)
        for name in ("patch_size", "temporal_patch_size", "merge_size",
                     "image_mean", "image_std", "rescale_factor"):
            if raw.get(name) is not None:
                kwargs[name] = raw[name]
        return cls(**kwargs)


def _size_from_json(raw: dict[str, Any], path: Path) -> dict[str, Any]:
    """min_pixels/max_pixels from either key style; empty when neither is given."""
    out: dict[str, Any] = {}
    size = raw.get("size")
    if size is not None:
        if not isinstance(size, dict):
            raise ValueError(f"{path}: size must be an object with shortest_edge and longest_edge, "
                             f"got {size!r}")
        if "shortest_edge" in size:
            out["min_pixels"] = size["shortest_edge"]
        if "longest_edge" in size:
            out["max_pixels"] = size["longest_edge"]
    for legacy in ("min_pixels", "max_pixels"):
        if raw.get(legacy) is not None:
            out[legacy] = raw[legacy]
    if size is not None and len(out) < 2:
        raise ValueError(f"{path}: size must contain shortest_edge and longest_edge "
                         f"(or give min_pixels and max_pixels), got {size!r}")
    return out


# ---------------------------------------------------------------- sizes

def smart_resize(height: int, width: int, factor: int, min_pixels: int,
                 max_pixels: int) -> tuple[int, int]:
    """The reference's target size: both sides multiples of `factor`, area within
    [min_pixels, max_pixels] where reachable, aspect ratio kept as nearly as possible."""
    for name, value in (("height", height), ("width", width), ("factor", factor)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    height, width, factor = int(height), int(width), int(factor)
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise ValueError(f"image aspect ratio must be at most {MAX_ASPECT_RATIO}:1, "
                         f"got {width}x{height} (ratio {ratio:.1f})")
    # Python's round() rounds halves to even; the reference relies on that too.
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def resized_size(height: int, width: int, cfg: ImageProcessorConfig) -> tuple[int, int]:
    """(height, width) the source is resized to before patching."""
    return smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)


def image_grid_thw(height: int, width: int, cfg: ImageProcessorConfig) -> tuple[int, int, int]:
    """(1, grid_h, grid_w) in patches, from the source size alone; a still image is one temporal step."""
    h, w = resized_size(height, width, cfg)
    return 1, h // cfg.patch_size, w // cfg.patch_size


def num_visual_tokens(height: int, width: int, cfg: ImageProcessorConfig) -> int:
    """Placeholder tokens the language model sees for this image: patches after merging."""
    _, grid_h, grid_w = image_grid_thw(height, width, cfg)
    return grid_h * grid_w // (cfg.merge_size**2)


# ---------------------------------------------------------------- decoding

class ImageDecodeError(ValueError):
    """Image bytes cannot be used; the message says why in one line."""


def _available_formats() -> tuple[str, ...]:
    """ALLOWED_FORMATS this Pillow build can read. Image.open(formats=...) only
    looks at plugins already registered, and registers the lazy ones (WEBP)
    only when called without `formats`, so register them here first."""
    Image.init()
    return tuple(name for name in ALLOWED_FORMATS if name in Image.OPEN)


def _open_header(data: bytes) -> Image.Image:
    """Parse the header only; no pixel data is decoded yet."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"image data must be bytes, got {type(data).__name__}")
    if len(data) == 0:
        raise ImageDecodeError("empty image data (0 bytes)")
    formats = _available_formats()
    try:
        return Image.open(io.BytesIO(data), formats=formats)
    except UnidentifiedImageError:
        raise ImageDecodeError(f"not a recognised image ({len(data)} bytes); "
                               f"supported formats: {', '.join(formats)}") from None
    except Image.DecompressionBombError as exc:
        # Pillow's own hard limit fires inside Image.open, before our check can.
        raise ImageDecodeError(f"image too large: {exc}") from None
    except DECODER_ERRORS as exc:
        raise ImageDecodeError(f"corrupt image header: {exc}") from None


def read_image_size(data: bytes) -> tuple[int, int]:
    """(height, width) from the image header, without decoding pixels.

    EXIF orientation is deliberately not applied: the processor does not apply
    it either, so this is exactly the size the processor sees."""
    with _open_header(data) as image:
        width, height = image.size
    return height, width


def check_source_size(height: int, width: int, cfg: ImageProcessorConfig) -> tuple[int, int, int]:
    """The patch grid for a source of this size; ImageDecodeError if it is too
    large (a decompression bomb) or cannot be resized (no pixels, extreme
    aspect ratio). Called with header sizes, before any pixel is decoded."""
    if width < 1 or height < 1:
        raise ImageDecodeError(f"image has no pixels ({width}x{height})")
    if width * height > cfg.max_image_pixels:
        raise ImageDecodeError(f"image too large: {width}x{height} = {width * height} pixels, "
                               f"over the limit of {cfg.max_image_pixels} (max_image_pixels)")
    try:
        return image_grid_thw(height, width, cfg)
    except ValueError as exc:  # smart_resize refusing the aspect ratio
        raise ImageDecodeError(str(exc)) from None


def convert_to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with any transparency composited onto white, as the reference does."""
    has_alpha = "A" in image.getbands() or image.info.get("transparency") is not None
    if has_alpha:
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, image.convert("RGBA")).convert("RGB")
    if image.mode == "RGB":
        # The reference's convert("RGB") would only copy; skip the copy.
        return image
    return image.convert("RGB")


def open_image(data: bytes, cfg: ImageProcessorConfig) -> Image.Image:
    """Decode image bytes into an RGB Pillow image.

    Raises ImageDecodeError for empty, unrecognised, truncated, corrupt or
    oversized input; the size limit is checked from the header before decoding.
    Raises RuntimeError when Pillow has been told to accept truncated files.
    """
    if ImageFile.LOAD_TRUNCATED_IMAGES:
        # A process-wide Pillow switch some libraries turn on; with it, truncated
        # files decode into partly grey images instead of failing.
        raise RuntimeError("PIL.ImageFile.LOAD_TRUNCATED_IMAGES is enabled in this process; "
                           "refusing to decode, since truncated images would be silently accepted")
    image = _open_header(data)
    check_source_size(image.height, image.width, cfg)
    try:
        image.load()
        return convert_to_rgb(image)
    except DECODER_ERRORS as exc:
        raise ImageDecodeError(f"corrupt or truncated {image.format} image: {exc}") from None


# ---------------------------------------------------------------- pixels

def _normalize_table(cfg: ImageProcessorConfig) -> np.ndarray:
    """[3 * 256] float32: the normalised value of every uint8 level, per channel.

    Each reference step is elementwise (uint8 -> float64 * rescale -> float32,
    then (x - mean) / std in float32), so looking levels up in a table computed
    with the same numpy ops is bit-identical and much cheaper than the arithmetic.
    """
    levels = np.arange(256, dtype=np.uint8).astype(np.float64) * cfg.rescale_factor
    scaled = levels.astype(np.float32)[None, :]
    mean = np.asarray(cfg.image_mean, dtype=np.float32)[:, None]
    std = np.asarray(cfg.image_std, dtype=np.float32)[:, None]
    return ((scaled - mean) / std).reshape(-1)


def _write_patches(rgb: np.ndarray, table: np.ndarray, cfg: ImageProcessorConfig,
                   out: np.ndarray) -> None:
    """Normalise one resized HWC uint8 image into `out` ([grid_h*grid_w, patch_dim] rows).

    Row order is merge-window major: (grid_h/m, grid_w/m, m, m); each row is
    (C, T, p, p), the still image repeated across the T temporal slots.
    """
    p, m, t = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    height, width, channels = rgb.shape
    gh, gw = height // p, width // p
    index = rgb.astype(np.intp)
    index += np.arange(channels, dtype=np.intp) * 256
    normalized = table[index]
    blocks = normalized.reshape(gh // m, m, p, gw // m, m, p, channels).transpose(0, 3, 1, 4, 6, 2, 5)
    target = out.reshape(gh // m, gw // m, m, m, channels, t, p, p)
    target[...] = blocks[:, :, :, :, :, None, :, :]


def preprocess_images(images: list[Image.Image],
                      cfg: ImageProcessorConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Images -> (pixel_values float32 [sum(grid_h*grid_w), patch_dim], grid_thw int64 [n, 3]).

    Any Pillow mode is accepted and converted to RGB first, as in the reference.
    """
    for i, image in enumerate(images):
        if not isinstance(image, Image.Image):
            raise TypeError(f"images[{i}] must be a PIL.Image.Image, got {type(image).__name__}")
    grids = [image_grid_thw(image.height, image.width, cfg) for image in images]
    rows = [gh * gw for _, gh, gw in grids]
    pixel_values = torch.empty((sum(rows), cfg.patch_dim), dtype=torch.float32)
    grid_thw = torch.tensor(grids, dtype=torch.int64).reshape(len(grids), 3)
    table = _normalize_table(cfg)
    out = pixel_values.numpy()  # shares memory: patches are written straight into the tensor
    start = 0
    for image, (_, gh, gw), n in zip(images, grids, rows):
        size = (gw * cfg.patch_size, gh * cfg.patch_size)
        rgb = convert_to_rgb(image)
        # Pillow's resize to the same size is a plain copy, so skipping it is exact.
        resized = rgb if rgb.size == size else rgb.resize(size, Image.Resampling.BICUBIC)
        _write_patches(np.asarray(resized), table, cfg, out[start:start + n])
        start += n
    return pixel_values, grid_thw
