"""Video processor settings: the presets equal the reference classes' defaults,
and a checkpoint folder is read as the reference reads it (which file wins,
legacy pixel keys, JSON nulls), with clear refusals of what is not supported."""

from __future__ import annotations

import dataclasses
import json

import pytest

import video_reference as ref
from pipeline.processing.video import plan_video
from pipeline.processing.video_config import (INTERVAL_VIDEO_DEFAULTS, TIMESTAMP_VIDEO_DEFAULTS,
                                              VideoProcessorConfig)

ref.require_torchvision()


def settings_of(processor) -> dict:
    """A reference video processor's settings, in our field names."""
    return dict(patch_size=processor.patch_size, temporal_patch_size=processor.temporal_patch_size,
                merge_size=processor.merge_size, min_pixels=processor.size.shortest_edge,
                max_pixels=processor.size.longest_edge, image_mean=tuple(processor.image_mean),
                image_std=tuple(processor.image_std), rescale_factor=processor.rescale_factor,
                sample_frames=bool(processor.do_sample_frames),
                fps=None if processor.fps is None else float(processor.fps), num_frames=processor.num_frames,
                min_frames=processor.min_frames, max_frames=processor.max_frames,
                cap_pixels_per_frame=bool(processor.cap_pixels_per_frame),
                max_video_tokens=processor.max_video_tokens)


def ours(cfg: VideoProcessorConfig) -> dict:
    return {name: getattr(cfg, name) for name in settings_of(ref.interval_processor())}


VARIANTS = {"interval": (ref.interval_processor, INTERVAL_VIDEO_DEFAULTS),
            "timestamp": (ref.timestamp_processor, TIMESTAMP_VIDEO_DEFAULTS)}


@pytest.mark.parametrize("variant", VARIANTS)
def test_presets_are_the_reference_class_defaults(variant, tmp_path):
    make, defaults = VARIANTS[variant]
    assert ours(defaults) == settings_of(make())
    assert VideoProcessorConfig.from_checkpoint(tmp_path, defaults) is defaults  # an empty folder


CUSTOM = dict(size={"shortest_edge": 2048, "longest_edge": 99999}, patch_size=16, merge_size=2,
              image_mean=[0.1, 0.2, 0.3], image_std=[0.9, 0.8, 0.7], min_frames=2, max_frames=32,
              do_sample_frames=True, fps=1.5, max_video_tokens=300)


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_saved_video_processor_is_read_as_the_reference_reads_it(variant, tmp_path):
    make, defaults = VARIANTS[variant]
    make(**CUSTOM).save_pretrained(tmp_path)
    loaded = type(make()).from_pretrained(tmp_path)
    assert ours(VideoProcessorConfig.from_checkpoint(tmp_path, defaults)) == settings_of(loaded)


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_processor_config_entry_wins_over_the_video_file(variant, tmp_path):
    make, defaults = VARIANTS[variant]
    make(**CUSTOM).save_pretrained(tmp_path)  # a stale video_preprocessor_config.json
    nested = dict(CUSTOM, size={"shortest_edge": 4096, "longest_edge": 8192}, fps=None, num_frames=6)
    (tmp_path / "processor_config.json").write_text(json.dumps({"video_processor": nested}))
    loaded = type(make()).from_pretrained(tmp_path)
    cfg = VideoProcessorConfig.from_checkpoint(tmp_path, defaults)
    assert ours(cfg) == settings_of(loaded)
    assert (cfg.min_pixels, cfg.max_pixels, cfg.fps, cfg.num_frames) == (4096, 8192, None, 6)


def test_an_image_processor_file_alone_configures_the_video_processor(tmp_path):
    # As the grid-interval checkpoints ship: only preprocessor_config.json, legacy pixel keys.
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(ref.QWEN2_5_VL_PUBLISHED))
    loaded = type(ref.interval_processor()).from_pretrained(tmp_path)
    cfg = VideoProcessorConfig.from_checkpoint(tmp_path, INTERVAL_VIDEO_DEFAULTS)
    assert ours(cfg) == settings_of(loaded)
    assert (cfg.min_pixels, cfg.max_pixels) == (3136, 12845056)


@pytest.mark.parametrize("variant", VARIANTS)
def test_legacy_pixel_keys_count_only_where_the_reference_reads_them(variant, tmp_path):
    make, defaults = VARIANTS[variant]
    raw = dict(size={"shortest_edge": 4096, "longest_edge": 65536}, min_pixels=1000, max_pixels=50000)
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(raw))
    loaded = type(make()).from_pretrained(tmp_path)
    cfg = VideoProcessorConfig.from_checkpoint(tmp_path, defaults)
    assert (cfg.min_pixels, cfg.max_pixels) == (loaded.size.shortest_edge, loaded.size.longest_edge)
    assert cfg.min_pixels == (1000 if defaults.rules.legacy_pixel_keys else 4096)


def test_a_null_fps_samples_every_frame_up_to_the_bound(tmp_path):
    # A JSON null is "no fps" in the reference: the timestamp variant then takes
    # min(max(total, min_frames), max_frames) frames.
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps({"fps": None, "max_frames": 20}))
    cfg = VideoProcessorConfig.from_checkpoint(tmp_path, TIMESTAMP_VIDEO_DEFAULTS)
    assert cfg.fps is None and cfg.sample_frames
    header = dataclasses.make_dataclass("Header", ["total_frames", "fps", "height", "width"])(50, 25.0, 64, 64)
    from transformers.video_utils import VideoMetadata
    expected = type(ref.timestamp_processor()).from_pretrained(tmp_path).sample_frames(
        VideoMetadata(total_num_frames=50, fps=25.0))
    assert plan_video(header, cfg).frame_indices == tuple(int(i) for i in expected)
    assert len(expected) == 20


@pytest.mark.parametrize("raw, message", [
    ({"do_resize": False}, "do_resize=False is not supported"),
    ({"resample": 2}, "resample=2 is not supported"),
    ({"size": {"shortest_edge": 100}}, "size must contain shortest_edge and longest_edge"),
    ({"size": [1, 2]}, "size must be an object"),
    ({"fps": 2, "num_frames": 8}, "exclusive"),
    ({"image_std": [1, 0, 1]}, r"image_std\[1\] must be > 0"),
    ({"size": {"shortest_edge": 9000, "longest_edge": 100}}, r"min_pixels \(9000\) must be <= max_pixels"),
    ({"max_frames": 2}, r"max_frames must be in \[4,"),
    ({"do_sample_frames": True}, "stride sampling needs fps or num_frames"),
])
def test_unsupported_settings_are_refused_by_name(tmp_path, raw, message):
    (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=message):
        VideoProcessorConfig.from_checkpoint(tmp_path, INTERVAL_VIDEO_DEFAULTS)


def test_settings_key_changes_with_any_setting():
    changed = dataclasses.replace(TIMESTAMP_VIDEO_DEFAULTS, fps=1.0)
    assert changed.settings_key() != TIMESTAMP_VIDEO_DEFAULTS.settings_key()
    assert TIMESTAMP_VIDEO_DEFAULTS.settings_key() != INTERVAL_VIDEO_DEFAULTS.settings_key()
    assert TIMESTAMP_VIDEO_DEFAULTS.settings_key().startswith("smart-resize-video-patches/v1|")
