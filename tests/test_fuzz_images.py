"""Property-based tests of what reads untrusted image bytes: the header
reader the proxy counts placeholders with (read_image_size +
check_source_size), the GPU backends' probe (pipeline/media/probe.py), and
the Pillow decode and preprocess the encoders run (open_image,
preprocess_images, through the Pillow backend).

Inputs are small valid PNG/JPEG/WebP/GIF/BMP files made with Pillow, then
mutated: truncated, bytes flipped, inserted or deleted, header integers
(the sizes) set to edge values. Each reader either gives a valid result or
raises ImageDecodeError; never another exception, never a hang, and never a
pixel buffer larger than the configured limit (a decompression bomb's header
is refused from the header, before anything is allocated).
"""

from __future__ import annotations

import io
import struct
import zlib
from contextlib import contextmanager
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image, ImageFile

from fuzz_helpers import bounded, fuzz, mutated
from pipeline.media.base import DecodedImage
from pipeline.media.pillow_backend import PillowBackend
from pipeline.media.probe import ImageHeader, probe
from pipeline.processing.image import (
    ImageDecodeError,
    ImageProcessorConfig,
    check_source_size,
    open_image,
    read_image_size,
)

SMALL = ImageProcessorConfig(max_image_pixels=1 << 16)  # header-size mutations hit our limit, not Pillow's
DEFAULT = ImageProcessorConfig()
CONFIGS = (SMALL, DEFAULT)
TIME_BOUND_S = 10.0


def _save(image: Image.Image, fmt: str, **options) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **options)
    return buf.getvalue()


def _picture(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    rgb = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
    return rgb.convert(mode)


def _palette_with_transparency() -> bytes:
    image = _picture(20, 9, "P", seed=4)
    return _save(image, "PNG", transparency=3)


def _animated(fmt: str) -> bytes:
    frames = [_picture(18, 10, seed=5), _picture(18, 10, seed=6)]
    return _save(frames[0], fmt, save_all=True, append_images=frames[1:], duration=50, loop=0)


def seed_files() -> dict[str, bytes]:
    """Valid small files of every allowed format, in the modes requests bring."""
    return {
        "png-rgb": _save(_picture(16, 12), "PNG"),
        "png-rgba": _save(_picture(15, 14, "RGBA", 1), "PNG"),
        "png-grey16": _save(_picture(13, 11, "L", 2).convert("I;16"), "PNG"),
        "png-1bit": _save(_picture(17, 9, "1", 3), "PNG"),
        "png-palette-transparent": _palette_with_transparency(),
        "jpeg": _save(_picture(16, 16, seed=7), "JPEG", quality=80),
        "jpeg-progressive": _save(_picture(24, 8, seed=8), "JPEG", progressive=True),
        "jpeg-grey": _save(_picture(9, 21, "L", 9), "JPEG"),
        "jpeg-cmyk": _save(_picture(12, 12, "CMYK", 10), "JPEG"),
        "webp-lossy": _save(_picture(16, 12, seed=11), "WEBP", quality=70),
        "webp-lossless-alpha": _save(_picture(12, 10, "RGBA", 12), "WEBP", lossless=True),
        "webp-animated": _animated("WEBP"),
        "gif": _save(_picture(14, 10, "P", 13), "GIF"),
        "gif-animated": _animated("GIF"),
        "bmp": _save(_picture(11, 7, seed=14), "BMP"),
    }


SEEDS = seed_files()


# ---------------------------------------------------------------- bombs: a small file, a huge header

def png_with_size(data: bytes, width: int, height: int) -> bytes:
    """The IHDR's size replaced, with its CRC recomputed (a bomb passes the checksum)."""
    buf = bytearray(data)
    buf[16:24] = struct.pack(">II", width, height)
    buf[29:33] = struct.pack(">I", zlib.crc32(bytes(buf[12:29])))
    return bytes(buf)


def gif_with_size(data: bytes, width: int, height: int) -> bytes:
    buf = bytearray(data)
    buf[6:10] = struct.pack("<HH", width, height)   # the logical screen
    return bytes(buf)


def jpeg_with_size(data: bytes, width: int, height: int) -> bytes:
    buf = bytearray(data)
    sof = buf.find(b"\xff\xc0")
    buf[sof + 5:sof + 9] = struct.pack(">HH", height, width)
    return bytes(buf)


def bmp_with_size(data: bytes, width: int, height: int) -> bytes:
    buf = bytearray(data)
    buf[18:26] = struct.pack("<ii", width, height)
    return bytes(buf)


def png_with_chunk(data: bytes, kind: bytes, body: bytes) -> bytes:
    """A chunk put right after the IHDR."""
    chunk = struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    return data[:33] + chunk + data[33:]


_ZEROS = zlib.compress(bytes(16 << 20), 9)   # 16 KiB that inflate to 16 MiB

BOMBS = {
    # Over our limit (64 Mpx by default) but under Pillow's own (2 x 89 Mpx):
    # only our header check stands between these and a full-size allocation.
    "png-9000x9000": png_with_size(SEEDS["png-rgb"], 9000, 9000),
    "gif-12000x6000": gif_with_size(SEEDS["gif"], 12000, 6000),
    "jpeg-10000x8000": jpeg_with_size(SEEDS["jpeg"], 10000, 8000),
    "bmp-9000x-9000": bmp_with_size(SEEDS["bmp"], 9000, -9000),   # top-down rows
    # Over Pillow's limit: refused inside Image.open, still as ImageDecodeError.
    "png-100000x100000": png_with_size(SEEDS["png-rgb"], 100_000, 100_000),
    "png-2^31x1": png_with_size(SEEDS["png-rgb"], 2**31 - 1, 1),
    "gif-65535x65535": gif_with_size(SEEDS["gif"], 0xFFFF, 0xFFFF),
    "jpeg-65500x65500": jpeg_with_size(SEEDS["jpeg"], 65500, 65500),
    # Compressed metadata that inflates far past what it says: Pillow's chunk limit.
    "png-ztxt-16MiB": png_with_chunk(SEEDS["png-rgb"], b"zTXt", b"k\0\0" + _ZEROS),
    "png-iccp-16MiB": png_with_chunk(SEEDS["png-rgb"], b"iCCP", b"p\0\0" + _ZEROS),
}


# ---------------------------------------------------------------- what is allocated

@contextmanager
def pixel_buffers():
    """Sizes of the pixel buffers Pillow allocates while the block runs: every
    file's decode allocates its image in ImageFile.load_prepare."""
    sizes: list[tuple[int, int]] = []
    original = ImageFile.ImageFile.load_prepare

    def recording(self):
        sizes.append(self.size)
        return original(self)

    with mock.patch.object(ImageFile.ImageFile, "load_prepare", recording):
        yield sizes


def check_header(data: bytes, cfg: ImageProcessorConfig) -> ImageHeader | ImageDecodeError:
    """The proxy's and the GPU backends' header paths agree, and their
    results are well formed."""
    try:
        height, width = read_image_size(data)
        grid = check_source_size(height, width, cfg)
    except ImageDecodeError as exc:
        with pytest.raises(ImageDecodeError):
            probe(data, cfg)
        return exc
    assert height >= 1 and width >= 1 and height * width <= cfg.max_image_pixels
    header = probe(data, cfg)
    assert (header.height, header.width, header.grid) == (height, width, grid)
    assert header.resized == (grid[1] * cfg.patch_size, grid[2] * cfg.patch_size)
    assert isinstance(header.gpu_jpeg, bool)
    return header


def check_decode(data: bytes, cfg: ImageProcessorConfig) -> None:
    """Header, then the Pillow backend's decode and preprocess: a result that
    matches the header's grid, or ImageDecodeError; buffers within the limit."""
    header = bounded(lambda: check_header(data, cfg), TIME_BOUND_S)
    backend = PillowBackend("cpu", num_threads=1)
    with pixel_buffers() as sizes:
        (result,) = bounded(lambda: backend.decode([data], cfg), TIME_BOUND_S)
    assert all(w * h <= cfg.max_image_pixels for w, h in sizes), sizes
    if isinstance(result, ImageDecodeError):
        return
    assert isinstance(result, DecodedImage), type(result)
    # Decoded means the header was good, and the placeholders the proxy
    # counted from it are the rows the encoder made.
    assert isinstance(header, ImageHeader), header
    assert result.grid == header.grid and result.source_size == header.source_size
    _, gh, gw = result.grid
    assert result.pixel_values.shape == (gh * gw, cfg.patch_dim)
    assert result.pixel_values.dtype == torch.float32 and torch.isfinite(result.pixel_values).all()


# ---------------------------------------------------------------- the properties

@pytest.mark.parametrize("name", sorted(SEEDS))
def test_the_seed_files_decode(name):
    """The mutations start from files every reader takes; decoding one
    allocates its pixels where pixel_buffers sees it."""
    header = check_header(SEEDS[name], DEFAULT)
    assert isinstance(header, ImageHeader)
    with pixel_buffers() as sizes:
        (result,) = PillowBackend("cpu", num_threads=1).decode([SEEDS[name]], DEFAULT)
    assert isinstance(result, DecodedImage) and result.grid == header.grid
    assert sizes[0] == (header.width, header.height)


@pytest.mark.parametrize("name", sorted(BOMBS))
def test_a_bomb_header_is_refused_before_any_pixel_is_allocated(name):
    with pixel_buffers() as sizes:
        for read in (lambda d: check_source_size(*read_image_size(d), DEFAULT),   # the proxy's
                     lambda d: probe(d, DEFAULT), lambda d: open_image(d, DEFAULT)):
            with pytest.raises(ImageDecodeError, match="too large"):
                read(BOMBS[name])
        (result,) = PillowBackend("cpu", num_threads=1).decode([BOMBS[name]], DEFAULT)
    assert isinstance(result, ImageDecodeError) and "too large" in str(result)
    assert sizes == []


@fuzz(150)
@given(data=st.sampled_from(sorted(SEEDS)).flatmap(lambda name: mutated(SEEDS[name])),
       cfg=st.sampled_from(CONFIGS))
def test_mutated_image_files_decode_or_fail_cleanly(data, cfg):
    check_decode(data, cfg)


@fuzz(150)
@given(data=st.sampled_from(sorted(SEEDS)).flatmap(lambda name: mutated(SEEDS[name], max_ops=1)),
       cfg=st.sampled_from(CONFIGS))
def test_images_with_one_edit_decode_or_fail_cleanly(data, cfg):
    """One edit only: most such files still open, so the decode path past the
    header is what gets exercised."""
    check_decode(data, cfg)


@fuzz(100)
@given(prefix=st.sampled_from([b"", b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF89a", b"RIFF\x00\x00\x00\x00WEBP",
                               b"BM"]),
       tail=st.binary(max_size=256))
def test_random_bytes_behind_a_magic_number_fail_cleanly(prefix, tail):
    check_decode(prefix + tail, DEFAULT)
