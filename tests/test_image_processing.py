"""Qwen2-VL image preprocessing, checked bit for bit against the reference
transformers Pillow processor (used here only as a test oracle)."""

from __future__ import annotations

import dataclasses
import io
import json
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image, ImageFile

from pipeline.processing.image import (
    ImageDecodeError,
    ImageProcessorConfig,
    image_grid_thw,
    num_visual_tokens,
    open_image,
    preprocess_images,
    read_image_size,
    smart_resize,
)

SIZES = [(20, 20), (91, 37), (37, 91), (224, 224), (333, 517), (720, 1280), (200, 3000)]
MODES = ["RGBA", "LA", "L", "P", "P-transparent", "RGB-transparent"]


# ---------------------------------------------------------------- helpers

@pytest.fixture(scope="module")
def reference():
    """Factory for the reference processor, built directly (AutoProcessor needs torchvision)."""
    pytest.importorskip("transformers")
    module = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    return module


def random_image(seed: int, height: int, width: int, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    if mode in ("RGBA", "LA"):
        pixels = rng.integers(0, 256, (height, width, 4), dtype=np.uint8)
        # Make sure fully transparent and fully opaque pixels both occur.
        pixels[0, :, 3] = 0
        pixels[-1, :, 3] = 255
        return Image.fromarray(pixels, "RGBA").convert(mode)
    rgb = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")
    if mode == "RGB":
        return rgb
    if mode == "L":
        return rgb.convert("L")
    if mode in ("P", "P-transparent"):
        image = rgb.quantize(colors=32)
        if mode == "P-transparent":
            image.info["transparency"] = 5
        return image
    if mode == "RGB-transparent":
        rgb.info["transparency"] = tuple(int(v) for v in np.asarray(rgb)[0, 0])
        return rgb
    raise ValueError(mode)


def encode(image: Image.Image, fmt: str, **kwargs) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kwargs)
    return buf.getvalue()


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_claiming_size(width: int, height: int) -> bytes:
    """A PNG header for an RGB image of the given size, with no pixel data.

    An empty IDAT follows IHDR because Pillow keeps reading chunks up to the
    first IDAT when it opens a PNG; without one the file is not recognised at all."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", b"")


def assert_matches_reference(reference, images, cfg: ImageProcessorConfig, **ref_kwargs) -> None:
    processor = reference.Qwen2VLImageProcessorPil(**ref_kwargs)
    expected = processor(images=images, return_tensors="np")
    pixel_values, grid_thw = preprocess_images(images, cfg)
    assert pixel_values.dtype == torch.float32 and grid_thw.dtype == torch.int64
    np.testing.assert_array_equal(grid_thw.numpy(), expected["image_grid_thw"])
    ours, theirs = pixel_values.numpy(), expected["pixel_values"]
    assert ours.shape == theirs.shape
    diff = float(np.abs(ours - theirs).max()) if ours.size else 0.0
    assert diff <= 1e-5
    assert np.array_equal(ours, theirs), f"not bit-identical (max abs diff {diff})"


# ---------------------------------------------------------------- pixels vs reference

@pytest.mark.parametrize("height,width", SIZES)
def test_rgb_matches_reference(reference, height, width):
    image = random_image(height * 7919 + width, height, width)
    assert_matches_reference(reference, [image], ImageProcessorConfig())


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("height,width", [(91, 37), (333, 517)])
def test_other_modes_match_reference(reference, mode, height, width):
    image = random_image(height + width, height, width, mode)
    assert_matches_reference(reference, [image], ImageProcessorConfig())


@pytest.mark.parametrize("min_pixels,max_pixels", [
    (28 * 28 * 16, 28 * 28 * 64),
    (784, 784 * 4),
    (56 * 56 * 50, 56 * 56 * 51),
])
@pytest.mark.parametrize("height,width", [(20, 20), (91, 37), (720, 1280), (200, 3000)])
def test_custom_pixel_bounds_match_reference(reference, min_pixels, max_pixels, height, width):
    image = random_image(min_pixels + height, height, width)
    cfg = ImageProcessorConfig(min_pixels=min_pixels, max_pixels=max_pixels)
    assert_matches_reference(reference, [image], cfg, min_pixels=min_pixels, max_pixels=max_pixels)


@pytest.mark.parametrize("patch_size,temporal_patch_size,merge_size", [(16, 2, 2), (14, 1, 1), (8, 3, 4)])
def test_other_patch_geometry_matches_reference(reference, patch_size, temporal_patch_size, merge_size):
    image = random_image(patch_size, 150, 230, "RGBA")
    cfg = ImageProcessorConfig(patch_size=patch_size, temporal_patch_size=temporal_patch_size,
                               merge_size=merge_size)
    assert_matches_reference(reference, [image], cfg, patch_size=patch_size,
                             temporal_patch_size=temporal_patch_size, merge_size=merge_size)


def test_batch_of_mixed_images_matches_reference(reference):
    images = [random_image(i, h, w, mode) for i, ((h, w), mode) in
              enumerate(zip([(91, 37), (20, 20), (333, 517), (64, 64)], ["RGB", "L", "RGBA", "P"]))]
    assert_matches_reference(reference, images, ImageProcessorConfig())


@pytest.mark.parametrize("kwargs", [
    dict(image_mean=[0.5, 0.25, 0.125], image_std=[0.3, 0.7, 0.9], rescale_factor=1 / 127.5),
    dict(image_mean=0.5, image_std=0.5),  # one number for all channels, as some checkpoints write
])
def test_custom_mean_std_and_rescale_match_reference(reference, kwargs):
    image = random_image(3, 120, 90)
    assert_matches_reference(reference, [image], ImageProcessorConfig(**kwargs), **kwargs)


def test_output_layout_and_empty_batch():
    cfg = ImageProcessorConfig()
    pixel_values, grid_thw = preprocess_images([random_image(0, 91, 37)], cfg)
    assert pixel_values.shape == (8 * 4, 3 * 2 * 14 * 14)
    assert grid_thw.tolist() == [[1, 8, 4]]
    empty_values, empty_grid = preprocess_images([], cfg)
    assert empty_values.shape == (0, cfg.patch_dim) and empty_grid.shape == (0, 3)
    with pytest.raises(TypeError, match="images\\[0\\]"):
        preprocess_images([np.zeros((28, 28, 3), dtype=np.uint8)], cfg)


# ---------------------------------------------------------------- sizes and token counts

def many_sizes(seed: int, count: int) -> list[tuple[int, int]]:
    rng = np.random.default_rng(seed)
    sizes = [(1, 1), (1, 200), (200, 1), (27, 28), (28, 28), (42, 42), (14, 14 * 200), (8192, 8192)]
    while len(sizes) < count:
        h, w = (int(v) for v in rng.integers(1, 6000, size=2))
        if max(h, w) / min(h, w) <= 200:
            sizes.append((h, w))
    return sizes


@pytest.mark.parametrize("kwargs", [
    {},
    {"min_pixels": 28 * 28 * 4, "max_pixels": 28 * 28 * 16384},
    {"min_pixels": 1000, "max_pixels": 200_000, "patch_size": 16},
])
def test_token_counts_match_reference(reference, kwargs):
    processor = reference.Qwen2VLImageProcessorPil(**kwargs)
    cfg = ImageProcessorConfig(**kwargs)
    for height, width in many_sizes(len(kwargs), 400):
        patches = processor.get_number_of_image_patches(height, width)
        assert num_visual_tokens(height, width, cfg) == patches // cfg.merge_size**2, (height, width)
        _, grid_h, grid_w = image_grid_thw(height, width, cfg)
        assert grid_h * grid_w == patches
        expected = reference.smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels)
        assert smart_resize(height, width, cfg.factor, cfg.min_pixels, cfg.max_pixels) == expected


def test_smart_resize_rejects_extreme_aspect_ratio(reference):
    with pytest.raises(ValueError):
        reference.smart_resize(10, 2010, 28, 3136, 1003520)
    with pytest.raises(ValueError, match="aspect ratio"):
        smart_resize(10, 2010, 28, 3136, 1003520)
    with pytest.raises(ValueError, match="height"):
        smart_resize(0, 10, 28, 3136, 1003520)


# ---------------------------------------------------------------- config

QWEN_JSON = {
    "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2,
    "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711], "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2_5_VLProcessor",
}


def write_config(tmp_path, raw) -> None:
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(raw))


def test_from_checkpoint_without_file_gives_defaults(tmp_path):
    assert ImageProcessorConfig.from_checkpoint(tmp_path) == ImageProcessorConfig()


def test_from_checkpoint_legacy_keys(tmp_path):
    write_config(tmp_path, QWEN_JSON)
    cfg = ImageProcessorConfig.from_checkpoint(tmp_path)
    assert (cfg.min_pixels, cfg.max_pixels) == (3136, 12845056)
    assert cfg.image_std == tuple(QWEN_JSON["image_std"])


def test_from_checkpoint_size_keys(tmp_path):
    raw = {"size": {"shortest_edge": 1000, "longest_edge": 500_000}, "patch_size": 16,
           "merge_size": 2, "rescale_factor": 0.00392156862745098, "do_resize": True, "resample": 3}
    write_config(tmp_path, raw)
    cfg = ImageProcessorConfig.from_checkpoint(tmp_path)
    assert (cfg.min_pixels, cfg.max_pixels, cfg.patch_size) == (1000, 500_000, 16)
    assert cfg.rescale_factor == 1 / 255


def test_from_checkpoint_legacy_keys_win_like_reference(reference, tmp_path):
    raw = {"size": {"shortest_edge": 1000, "longest_edge": 500_000}, "max_pixels": 300_000}
    write_config(tmp_path, raw)
    cfg = ImageProcessorConfig.from_checkpoint(tmp_path)
    processor = reference.Qwen2VLImageProcessorPil(**raw)
    assert (cfg.min_pixels, cfg.max_pixels) == (processor.size["shortest_edge"], processor.size["longest_edge"])
    assert (cfg.min_pixels, cfg.max_pixels) == (1000, 300_000)


@pytest.mark.parametrize("update,field", [
    ({"patch_size": 0}, "patch_size"),
    ({"merge_size": "2"}, "merge_size"),
    ({"temporal_patch_size": 2.0}, "temporal_patch_size"),
    ({"image_std": [0.1, 0.0, 0.2]}, "image_std"),
    ({"image_mean": [0.5, 0.5]}, "image_mean"),
    ({"min_pixels": 5000, "max_pixels": 4000}, "min_pixels"),
    ({"max_pixels": 100}, "max_pixels"),
    ({"rescale_factor": -1}, "rescale_factor"),
    ({"size": {"shortest_edge": 100}, "min_pixels": None, "max_pixels": None}, "size"),
    ({"size": [100, 200], "min_pixels": None, "max_pixels": None}, "size"),
    ({"do_normalize": False}, "do_normalize"),
    ({"resample": 2}, "resample"),
])
def test_from_checkpoint_rejects_bad_values(tmp_path, update, field):
    write_config(tmp_path, {**QWEN_JSON, **update})
    with pytest.raises(ValueError, match=field):
        ImageProcessorConfig.from_checkpoint(tmp_path)


def test_from_checkpoint_rejects_unreadable_file(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="preprocessor_config.json"):
        ImageProcessorConfig.from_checkpoint(tmp_path)


def test_constructor_validates_with_range_in_message():
    with pytest.raises(ValueError, match=r"max_image_pixels must be in \[1, "):
        ImageProcessorConfig(max_image_pixels=0)
    with pytest.raises(ValueError, match=r"patch_size must be in \[1, 1024\], got 0"):
        ImageProcessorConfig(patch_size=0)


def test_settings_key_is_stable_and_covers_every_field():
    base = ImageProcessorConfig()
    assert base.settings_key() == ImageProcessorConfig().settings_key()
    changes = {"patch_size": 16, "temporal_patch_size": 1, "merge_size": 1, "min_pixels": 1000,
               "max_pixels": 2_000_000, "image_mean": (0.5, 0.5, 0.5), "image_std": (0.5, 0.5, 0.5),
               "rescale_factor": 1 / 256, "max_image_pixels": 1000}
    assert set(changes) == {f.name for f in dataclasses.fields(base)}
    keys = {dataclasses.replace(base, **{name: value}).settings_key() for name, value in changes.items()}
    assert len(keys) == len(changes) and base.settings_key() not in keys


# ---------------------------------------------------------------- decoding

def test_open_image_rejects_empty_bytes():
    with pytest.raises(ImageDecodeError, match="empty"):
        open_image(b"", ImageProcessorConfig())


def test_open_image_rejects_non_image_bytes():
    with pytest.raises(ImageDecodeError, match="not a recognised image"):
        open_image(b"this is certainly not an image\n" * 10, ImageProcessorConfig())


def test_open_image_refuses_formats_outside_the_allow_list():
    eps = encode(random_image(1, 16, 16), "EPS")
    assert Image.open(io.BytesIO(eps)).format == "EPS"
    with pytest.raises(ImageDecodeError, match="not a recognised image"):
        open_image(eps, ImageProcessorConfig())


def test_open_image_rejects_truncated_jpeg():
    data = encode(random_image(2, 256, 256), "JPEG", quality=90)
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False
    with pytest.raises(ImageDecodeError, match="truncated"):
        open_image(data[: len(data) // 2], ImageProcessorConfig())


def test_open_image_rejects_corrupt_png():
    data = bytearray(encode(random_image(3, 64, 64), "PNG"))
    idat = data.index(b"IDAT")
    data[idat + 40: idat + 60] = bytes(20)
    with pytest.raises(ImageDecodeError):
        open_image(bytes(data), ImageProcessorConfig())


def test_open_image_refuses_when_pillow_accepts_truncated_images(monkeypatch):
    data = encode(random_image(2, 32, 32), "JPEG")
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", True)
    with pytest.raises(RuntimeError, match="LOAD_TRUNCATED_IMAGES"):
        open_image(data, ImageProcessorConfig())


def test_open_image_rejects_huge_header_before_decoding():
    data = png_claiming_size(100_000, 100_000)
    with pytest.raises(ImageDecodeError, match="too large"):
        open_image(data, ImageProcessorConfig())
    with pytest.raises(ImageDecodeError, match="too large"):
        read_image_size(data)


def test_open_image_applies_max_image_pixels_from_header():
    # Under Pillow's own limit, so only our check can refuse it; there are no
    # pixels in the file, so the refusal must come from the header alone.
    data = png_claiming_size(9000, 9000)
    assert read_image_size(data) == (9000, 9000)
    with pytest.raises(ImageDecodeError, match=r"too large: 9000x9000 .*max_image_pixels"):
        open_image(data, ImageProcessorConfig())
    small = encode(random_image(4, 100, 100), "PNG")
    with pytest.raises(ImageDecodeError, match="too large"):
        open_image(small, ImageProcessorConfig(max_image_pixels=99 * 100))


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF", "BMP"])
def test_read_image_size_matches_decoded_size(fmt):
    image = random_image(5, 91, 37, "RGB")
    data = encode(image, fmt)
    decoded = open_image(data, ImageProcessorConfig())
    assert read_image_size(data) == (91, 37) == (decoded.height, decoded.width)
    assert decoded.mode == "RGB"


@pytest.mark.parametrize("mode,fmt", [("RGBA", "PNG"), ("LA", "PNG"), ("P-transparent", "PNG"),
                                      ("L", "JPEG"), ("RGB", "JPEG")])
def test_open_image_then_preprocess_matches_reference(reference, mode, fmt):
    data = encode(random_image(6, 150, 110, mode), fmt)
    cfg = ImageProcessorConfig()
    ours, _ = preprocess_images([open_image(data, cfg)], cfg)
    processor = reference.Qwen2VLImageProcessorPil()
    theirs = processor(images=[Image.open(io.BytesIO(data))], return_tensors="np")["pixel_values"]
    assert np.array_equal(ours.numpy(), theirs)
