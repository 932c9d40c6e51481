"""Qwen3-VL image preprocessing, bit for bit against the reference.

The reference is transformers' PIL image processor configured as the
published Qwen3-VL checkpoints configure it (16-pixel patches, mean and std
0.5, area between 256x256 and 4096x4096), saved with its own save_pretrained
and loaded back with AutoImageProcessor; ours reads the same folder through
ImageProcessorConfig.from_checkpoint, the serving stack's path, and decodes
through the Pillow media backend as the encoder does.

Pixels at the published upper bound would be 400 MB per image, so images
that hit the downscale are compared under a lower longest_edge (the same
code path); grids and token counts are compared at the published bounds for
sizes up to 35 megapixels, which costs no pixels.
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import image_bytes, random_image
from pipeline.media.pillow_backend import PillowBackend
from pipeline.processing.image import (ImageProcessorConfig, image_grid_thw, num_visual_tokens,
                                       preprocess_images)

pytest.importorskip("transformers")
import qwen3_vl_helpers as helpers  # noqa: E402

MERGE = 4  # merge_size ** 2
# Upscaled to the 256x256 floor (a 20x30 image becomes 224x320), odd aspect
# ratios both ways, already on the 32-pixel grid, and near the 200:1 limit.
SIZES = [(20, 30), (37, 500), (500, 37), (333, 517), (480, 640), (20, 3000)]
CAPPED_EDGE = 512 * 512
CAPPED_SIZES = [(1500, 2000), (2000, 1100), (700, 699)]
TOKEN_SIZES = [(1, 1), (16, 16), (31, 33), (255, 257), (720, 1280), (1080, 1920), (3000, 4000),
               (4096, 4096), (4097, 4095), (5000, 7000), (100, 19999), (19999, 100)]


@pytest.fixture(scope="module")
def published_dir(tmp_path_factory):
    return _saved(tmp_path_factory.mktemp("qwen3-vl-processor"))


@pytest.fixture(scope="module")
def capped_dir(tmp_path_factory):
    size = {"shortest_edge": 65536, "longest_edge": CAPPED_EDGE}
    return _saved(tmp_path_factory.mktemp("qwen3-vl-capped"), size=size)


def _saved(folder, **overrides):
    helpers.published_image_processor(**overrides).save_pretrained(folder)
    return folder


def reference_for(folder):
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(folder, backend="pil")


def assert_pixels_equal(ours: torch.Tensor, theirs: np.ndarray) -> None:
    assert ours.dtype == torch.float32 and theirs.dtype == np.float32
    assert tuple(ours.shape) == theirs.shape
    assert np.array_equal(ours.numpy(), theirs), f"max abs diff {np.abs(ours.numpy() - theirs).max()}"


def test_saved_settings_are_read_as_published(published_dir):
    raw = json.loads((published_dir / "preprocessor_config.json").read_text())
    assert raw["size"] == {"shortest_edge": 65536, "longest_edge": 16777216}
    cfg = ImageProcessorConfig.from_checkpoint(published_dir)
    assert (cfg.patch_size, cfg.temporal_patch_size, cfg.merge_size) == (16, 2, 2)
    assert (cfg.min_pixels, cfg.max_pixels) == (65536, 16777216)
    assert cfg.image_mean == cfg.image_std == (0.5, 0.5, 0.5) and cfg.rescale_factor == 1 / 255
    assert cfg.factor == 32 and cfg.patch_dim == 1536
    assert "qwen" not in cfg.settings_key().lower()


@pytest.mark.parametrize("height,width", SIZES)
def test_pixels_match_reference(published_dir, height, width):
    image = random_image(height, width, seed=height * 131 + width)
    expected = reference_for(published_dir)(images=[image], return_tensors="np")
    pixels, grid = preprocess_images([image], ImageProcessorConfig.from_checkpoint(published_dir))
    assert np.array_equal(grid.numpy(), expected["image_grid_thw"])
    assert_pixels_equal(pixels, expected["pixel_values"])


@pytest.mark.parametrize("height,width", CAPPED_SIZES)
def test_downscaled_pixels_match_reference(capped_dir, height, width):
    image = random_image(height, width, seed=height + width)
    expected = reference_for(capped_dir)(images=[image], return_tensors="np")
    cfg = ImageProcessorConfig.from_checkpoint(capped_dir)
    pixels, grid = preprocess_images([image], cfg)
    _, grid_h, grid_w = grid[0].tolist()
    assert grid_h * grid_w * 256 <= CAPPED_EDGE < height * width
    assert np.array_equal(grid.numpy(), expected["image_grid_thw"])
    assert_pixels_equal(pixels, expected["pixel_values"])


@pytest.mark.parametrize("fmt,mode", [("PNG", "RGB"), ("JPEG", "RGB"), ("PNG", "RGBA"), ("JPEG", "L")])
def test_media_backend_matches_reference(published_dir, capped_dir, fmt, mode):
    """Encoded bytes through the encoder's decode path, against the reference
    fed the same bytes opened by Pillow (as test_media does)."""
    sizes = [(20, 30), (333, 517), (1500, 2000)]
    blobs = [image_bytes(random_image(h, w, seed=h, mode=mode), fmt) for h, w in sizes]
    with PillowBackend("cpu", num_threads=2) as backend:
        for folder in (published_dir, capped_dir):
            cfg = ImageProcessorConfig.from_checkpoint(folder)
            for blob, size, decoded in zip(blobs, sizes, backend.decode(blobs, cfg)):
                with Image.open(io.BytesIO(blob)) as image:
                    expected = reference_for(folder)(images=[image], return_tensors="np")
                assert decoded.source_size == size
                assert decoded.grid == tuple(expected["image_grid_thw"][0].tolist())
                assert_pixels_equal(decoded.pixel_values, expected["pixel_values"])


def test_batch_matches_reference(published_dir):
    images = [random_image(h, w, seed=i) for i, (h, w) in enumerate(SIZES[:4])]
    expected = reference_for(published_dir)(images=images, return_tensors="np")
    pixels, grid = preprocess_images(images, ImageProcessorConfig.from_checkpoint(published_dir))
    assert np.array_equal(grid.numpy(), expected["image_grid_thw"])
    assert_pixels_equal(pixels, expected["pixel_values"])


def test_grids_and_token_counts_match_reference(published_dir):
    reference = reference_for(published_dir)
    cfg = ImageProcessorConfig.from_checkpoint(published_dir)
    for height, width in TOKEN_SIZES:
        patches = reference.get_number_of_image_patches(height, width, {})
        _, grid_h, grid_w = image_grid_thw(height, width, cfg)
        assert grid_h * grid_w == patches, (height, width)
        assert num_visual_tokens(height, width, cfg) == patches // MERGE
        assert 64 <= patches // MERGE <= 16384  # the 256x256 floor and the 4096x4096 cap


def test_placeholder_count_matches_reference_image_tokens(published_dir):
    """The count a prompt reserves equals the tokens the reference's grid gives."""
    cfg = ImageProcessorConfig.from_checkpoint(published_dir)
    for height, width in SIZES:
        expected = reference_for(published_dir)(images=[random_image(height, width)], return_tensors="np")
        assert num_visual_tokens(height, width, cfg) == int(expected["image_grid_thw"][0].prod()) // MERGE


# ---------------------------------------------------------------- processor_config.json

def processor_json(image_processor) -> dict:
    """processor_config.json as a transformers 5 processor's save_pretrained
    writes it: each sub-processor's settings under its own key."""
    return {"image_processor": image_processor.to_dict(), "processor_class": "Qwen3VLProcessor",
            "video_processor": None}


def test_settings_nested_in_processor_config_are_read(tmp_path, published_dir):
    (tmp_path / "processor_config.json").write_text(
        json.dumps(processor_json(reference_for(published_dir))))
    assert not (tmp_path / "preprocessor_config.json").exists()
    assert ImageProcessorConfig.from_checkpoint(tmp_path) == ImageProcessorConfig.from_checkpoint(published_dir)
    assert reference_for(tmp_path).size.longest_edge == 16777216


def test_processor_config_wins_over_preprocessor_config_like_reference(tmp_path, capped_dir):
    helpers.published_image_processor().save_pretrained(tmp_path)
    (tmp_path / "processor_config.json").write_text(json.dumps(processor_json(reference_for(capped_dir))))
    cfg = ImageProcessorConfig.from_checkpoint(tmp_path)
    reference = reference_for(tmp_path)
    assert cfg.max_pixels == reference.size.longest_edge == CAPPED_EDGE


def test_processor_config_without_image_settings_falls_to_preprocessor_config(tmp_path, capped_dir):
    helpers.published_image_processor().save_pretrained(tmp_path)
    (tmp_path / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen3VLProcessor"}))
    assert ImageProcessorConfig.from_checkpoint(tmp_path).max_pixels == 16777216


@pytest.mark.parametrize("content,match", [
    ("{not json", "processor_config.json"),
    ('{"image_processor": [1, 2]}', "image_processor must be an object"),
    ('{"image_processor": {"patch_size": 16, "do_resize": false}}', r"image_processor\).*do_resize"),
])
def test_bad_processor_config_is_refused(tmp_path, content, match):
    (tmp_path / "processor_config.json").write_text(content)
    with pytest.raises(ValueError, match=match):
        ImageProcessorConfig.from_checkpoint(tmp_path)
