"""Smart-resize patch image preprocessing: bytes -> RGB -> resized, normalised patches.

Bit-exact with the reference: the smart-resize patch image processor of these
checkpoints (transformers' PIL image processor for them), with the same
Pillow bicubic resize, the same float64 rescale then float32 normalise and
the same patch order. The grid and the number of visual tokens depend only
on the source height and width, so a front end can count tokens from the
image header without decoding any pixels. The settings are image_config.py's.
"""

from __future__ import annotations

import io
import math
import numbers
import struct
import zlib

import numpy as np
import torch
from PIL import Image, ImageFile, UnidentifiedImageError

# Re-exported: callers import the settings with the functions that use them.
from pipeline.processing.image_config import CHANNELS, ImageProcessorConfig

__all__ = ["CHANNELS", "ImageDecodeError", "ImageProcessorConfig", "check_source_size", "convert_to_rgb",
           "image_grid_thw", "num_visual_tokens", "open_image", "preprocess_images", "read_image_size",
           "resized_size", "smart_resize"]

MAX_ASPECT_RATIO = 200
# Formats a request may carry. Pillow can read more, but some plugins are a
# large attack surface (EPS even runs Ghostscript), so the rest are refused.
# JPEG's opener also yields multi-picture (MPO) files, as phone cameras write.
ALLOWED_FORMATS = ("JPEG", "PNG", "WEBP", "GIF", "BMP")
# What Pillow raises from a plugin or decoder fed corrupt data.
DECODER_ERRORS = (OSError, SyntaxError, ValueError, EOFError, struct.error, zlib.error)


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
