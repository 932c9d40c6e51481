"""The oracle side of the video tests: transformers' video processors and the
processors that add second_per_grid_ts and timestamp text, built as the
checkpoints configure them.

Imports transformers (and, through it, torchvision, made importable by
torchvision_compat first), so it lives with the tests, never on the serving path.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

import torchvision_compat

# The published checkpoints' video settings: Qwen2.5-VL ships only the image
# processor's preprocessor_config.json, which its video processor also reads;
# Qwen3-VL ships a video_preprocessor_config.json.
QWEN2_5_VL_PUBLISHED = dict(min_pixels=3136, max_pixels=12845056, patch_size=14, temporal_patch_size=2,
                            merge_size=2, image_mean=[0.48145466, 0.4578275, 0.40821073],
                            image_std=[0.26862954, 0.26130258, 0.27577711])
QWEN3_VL_PUBLISHED = dict(size={"shortest_edge": 4096, "longest_edge": 25165824}, patch_size=16,
                          temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
                          fps=2, min_frames=4, max_frames=768, do_sample_frames=True)
SPECIAL = ("<|video_pad|>", "<|vision_start|>", "<|vision_end|>")


def require_torchvision():
    """torchvision, importable; skips the test (or, at import, the module) where it is missing."""
    try:
        return torchvision_compat.import_torchvision()
    except ImportError as exc:
        pytest.skip(f"the reference video processors need torchvision: {exc}", allow_module_level=True)


def interval_processor(**settings):
    """The reference video processor of the grid-interval variant (Qwen2.5-VL's)."""
    require_torchvision()
    from transformers import Qwen2VLVideoProcessor

    return Qwen2VLVideoProcessor(**settings)


def timestamp_processor(**settings):
    """The reference video processor of the timestamp variant (Qwen3-VL's)."""
    require_torchvision()
    from transformers import Qwen3VLVideoProcessor

    return Qwen3VLVideoProcessor(**settings)


def reference_metadata(data: bytes):
    """The reference PyAV reader's VideoMetadata for these bytes (frames not kept)."""
    torchvision_compat.patch_torchvision()  # transformers imports torchvision wherever it is installed
    from transformers.video_utils import read_video_pyav

    _, metadata = read_video_pyav(io.BytesIO(data), lambda metadata, **_: [0])
    metadata.frames_indices = None
    return metadata


def reference_frames(data: bytes, indices) -> np.ndarray:
    """The reference PyAV reader's frames at sorted unique `indices`."""
    torchvision_compat.patch_torchvision()
    from transformers.video_utils import read_video_pyav

    video, _ = read_video_pyav(io.BytesIO(data), lambda metadata, **_: list(indices))
    return video


def run_video_processor(processor, frames: np.ndarray, metadata: dict, **call):
    """pixel_values_videos, video_grid_thw and the sampled metadata of one clip.

    The whole decoded clip goes in with its metadata, so the reference samples
    the frames itself; cap_pixels_per_frame is passed explicitly (unset, the
    reference warns and uses False)."""
    call.setdefault("cap_pixels_per_frame", False)
    out = processor(videos=[frames], video_metadata=[dict(metadata)], return_metadata=True,
                    return_tensors="pt", **call)
    return out["pixel_values_videos"], out["video_grid_thw"], out["video_metadata"][0]


def tokenizer_dir(tmp_path: Path) -> Path:
    from pipeline.models.tiny_tokenizer import write_tiny_tokenizer

    write_tiny_tokenizer(tmp_path)
    return tmp_path


def interval_prompt_processor(model_dir: Path, video_processor):
    """Qwen2_5_VLProcessor over the tiny tokenizer: it adds second_per_grid_ts."""
    from transformers import AutoTokenizer, Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2_5_VLProcessor(image_processor=Qwen2VLImageProcessorPil(),
                               tokenizer=AutoTokenizer.from_pretrained(model_dir),
                               video_processor=video_processor)


def timestamp_prompt_processor(model_dir: Path, video_processor):
    """Qwen3VLProcessor over the tiny tokenizer: it writes the timestamp text."""
    from transformers import AutoTokenizer, Qwen3VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen3VLProcessor(image_processor=Qwen2VLImageProcessorPil(patch_size=16),
                            tokenizer=AutoTokenizer.from_pretrained(model_dir),
                            video_processor=video_processor)
