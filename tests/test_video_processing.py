"""Video preprocessing against the reference video processors (Qwen2VLVideoProcessor,
which Qwen2.5-VL uses, and Qwen3VLVideoProcessor) and the processors around
them (Qwen2_5_VLProcessor's second_per_grid_ts, Qwen3VLProcessor's timestamp
text): frame indices, grids, token counts from the header alone, pixel values
bit for bit, seconds per grid step and timestamps.

Pixels are compared exactly: the reference's video path is torchvision's
tensor resize (there is no PIL path for video), which on the CPU is torch's
own antialiased bicubic uint8 kernel, and this code calls the same kernel
with the same fused (x - mean/r) / (std/r) float32 arithmetic.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import video_reference as ref
from pipeline.media.video_cpu import decode_video, plan_video_bytes
from pipeline.media.video_probe import VideoDecodeError, decode_frames, probe_video
from pipeline.processing.video import (VideoOptions, clip_smart_resize, plan_video, preprocess_video, resize_frames,
                                       resize_frames_two_pass, sample_frame_indices, timestamp_label,
                                       timestamp_prompt, video_token_count)
from pipeline.processing.video_config import INTERVAL_VIDEO_DEFAULTS, TIMESTAMP_VIDEO_DEFAULTS, VideoProcessorConfig
from video_clips import NTSC, decode_all, write_clip

ref.require_torchvision()
from transformers.video_utils import VideoMetadata  # noqa: E402

CLIPS = {
    "10fps-0.5s-64x48": (5, 10, 64, 48, "libx264"),
    "24fps-3s-200x120": (72, 24, 200, 120, "mpeg4"),
    "29.97fps-3s-96x64": (90, NTSC, 96, 64, "libx264"),
    "30fps-7s-64x48": (210, 30, 64, 48, "libx264"),
    "10fps-3s-40x24": (30, 10, 40, 24, "libx264"),  # narrower than one merged token
}


@pytest.fixture(scope="module")
def clips():
    out = {}
    for i, (name, (n, fps, w, h, codec)) in enumerate(CLIPS.items()):
        clip = write_clip(n, fps, w, h, codec=codec, seed=10 + i)
        out[name] = (clip, probe_video(clip.data), ref.reference_metadata(clip.data), decode_all(clip.data))
    return out


def saved_config(tmp_path, processor, defaults: VideoProcessorConfig) -> VideoProcessorConfig:
    """Our settings, read from the folder the reference processor saved itself to."""
    processor.save_pretrained(tmp_path)
    return VideoProcessorConfig.from_checkpoint(tmp_path, defaults)


def reference_call(cfg: VideoProcessorConfig, options: VideoOptions | None) -> dict:
    """The reference call that asks what `options` ask, as the chat template path does:
    a request's fps or num_frames turns sampling on; num_frames replaces the default fps."""
    call = dict(cap_pixels_per_frame=cfg.cap_pixels_per_frame)
    if options is not None and options.fps is not None:
        call.update(do_sample_frames=True, fps=options.fps)
    if options is not None and options.num_frames is not None:
        call.update(do_sample_frames=True, num_frames=options.num_frames, fps=None)
    return call


# ---------------------------------------------------------------- (c) frame indices

TOTALS = [*range(1, 80), 99, 100, 101, 149, 150, 151, 299, 300, 301, 1000, 1799, 5000]
VIDEO_RATES = [10.0, 24000 / 1001, 24.0, 25.0, 30000 / 1001, 30.0, 60.0]
REQUESTS = [dict(fps=0.5), dict(fps=1.0), dict(fps=2.0), dict(fps=3.3),
            *(dict(num_frames=n) for n in (1, 2, 3, 7, 8, 16))]


def _indices_or_error(call):
    try:
        return tuple(int(i) for i in call())
    except (ValueError, ZeroDivisionError):
        return "error"


@pytest.mark.parametrize("variant", ["interval", "timestamp"])
@pytest.mark.parametrize("bounds", [dict(), dict(min_frames=6, max_frames=16)])
def test_sampled_indices_equal_the_reference(variant, bounds):
    make, defaults = ((ref.interval_processor, INTERVAL_VIDEO_DEFAULTS) if variant == "interval"
                      else (ref.timestamp_processor, TIMESTAMP_VIDEO_DEFAULTS))
    processor, cfg = make(**bounds), dataclasses.replace(defaults, **bounds)
    checked = 0
    for total in TOTALS:
        for rate in VIDEO_RATES:
            metadata = VideoMetadata(total_num_frames=total, fps=rate)
            for request in REQUESTS:
                fps, num = request.get("fps"), request.get("num_frames")
                theirs = _indices_or_error(lambda: processor.sample_frames(metadata, fps=fps, num_frames=num))
                ours = _indices_or_error(lambda: sample_frame_indices(total, rate, cfg, fps, num))
                assert ours == theirs, (total, rate, request)
                checked += theirs != "error"
    assert checked > 1000


def test_stride_sampling_keeps_the_references_extra_index():
    # torch.arange's length rule gives 15 indices where 14 were asked: the
    # reference then pads to 16 frames, 8 temporal steps; so must we.
    indices = sample_frame_indices(17, 10.0, INTERVAL_VIDEO_DEFAULTS, None, 14)
    assert len(indices) == 15


def test_defaults_sample_as_the_reference_classes_do(clips):
    clip, header, metadata, frames = clips["30fps-7s-64x48"]
    for make, cfg in ((ref.interval_processor, INTERVAL_VIDEO_DEFAULTS),
                      (ref.timestamp_processor, TIMESTAMP_VIDEO_DEFAULTS)):
        _, grid, sampled = ref.run_video_processor(make(size={"shortest_edge": 1024, "longest_edge": 4096}),
                                                   frames, metadata)
        expected = range(header.total_frames) if sampled.frames_indices is None else sampled.frames_indices
        assert plan_video(header, cfg).frame_indices == tuple(int(i) for i in expected)


# ---------------------------------------------------------------- (d) pixels, grids, token counts

def _interval(**settings):
    return ref.interval_processor(**settings), INTERVAL_VIDEO_DEFAULTS


def _timestamp(**settings):
    return ref.timestamp_processor(**settings), TIMESTAMP_VIDEO_DEFAULTS


PIXEL_CASES = {
    "interval-defaults-every-frame": (_interval, {}, "10fps-0.5s-64x48", None, False),
    "interval-defaults-fps2": (_interval, {}, "24fps-3s-200x120", VideoOptions(fps=2.0), False),
    "interval-published-fps2": (_interval, ref.QWEN2_5_VL_PUBLISHED, "29.97fps-3s-96x64", VideoOptions(fps=2.0), False),
    "interval-small-budget-num9": (_interval, dict(min_pixels=784, max_pixels=28 * 28 * 6), "24fps-3s-200x120",
                                   VideoOptions(num_frames=9), False),
    "interval-capped": (_interval, dict(max_video_tokens=64, size={"shortest_edge": 784, "longest_edge": 602112}),
                        "24fps-3s-200x120", VideoOptions(fps=4.0), True),
    "timestamp-defaults": (_timestamp, {}, "30fps-7s-64x48", None, False),
    "timestamp-published": (_timestamp, ref.QWEN3_VL_PUBLISHED, "24fps-3s-200x120", None, False),
    "timestamp-short-clip": (_timestamp, ref.QWEN3_VL_PUBLISHED, "10fps-0.5s-64x48", None, False),
    "timestamp-odd-num7": (_timestamp, {}, "29.97fps-3s-96x64", VideoOptions(num_frames=7), False),
    "timestamp-narrow-frames": (_timestamp, {}, "10fps-3s-40x24", VideoOptions(fps=1.0), False),
    "timestamp-clip-budget": (_timestamp, dict(size={"shortest_edge": 1024, "longest_edge": 6 * 32 * 32 * 4}),
                              "24fps-3s-200x120", VideoOptions(fps=3.0), False),
    "timestamp-capped": (_timestamp, dict(max_video_tokens=4, size={"shortest_edge": 1024, "longest_edge": 786432}),
                         "24fps-3s-200x120", None, True),
}


@pytest.mark.parametrize("case", PIXEL_CASES)
def test_pixels_grid_and_token_count_equal_the_reference(clips, tmp_path, case):
    make, settings, clip_name, options, capped = PIXEL_CASES[case]
    processor, defaults = make(**settings)
    cfg = dataclasses.replace(saved_config(tmp_path, processor, defaults), cap_pixels_per_frame=capped)
    clip, header, metadata, frames = clips[clip_name]

    plan = plan_video(header, cfg, options)  # the header alone
    ours, grid = preprocess_video(decode_frames(clip.data, plan.frame_indices, header.total_frames), plan, cfg)
    theirs, their_grid, sampled = ref.run_video_processor(processor, frames, metadata,
                                                          **reference_call(cfg, options))
    if sampled.frames_indices is not None:
        assert plan.frame_indices == tuple(int(i) for i in sampled.frames_indices)
    assert grid.tolist() == their_grid.tolist() == [list(plan.grid)]
    assert ours.dtype == theirs.dtype == torch.float32 and torch.equal(ours, theirs)
    assert video_token_count(header, cfg, options) == int(their_grid.prod()) // cfg.merge_size**2
    assert plan.num_tokens * cfg.merge_size**2 == ours.shape[0]
    if not capped:  # the reference's own count from sizes (Qwen2VL's ignores the cap)
        patches = processor.get_num_of_video_patches(len(plan.frame_indices), header.height, header.width, {})
        assert plan.num_tokens == patches // cfg.merge_size**2


def test_one_call_from_bytes_equals_the_reference(clips):
    clip, header, metadata, frames = clips["29.97fps-3s-96x64"]
    cfg = dataclasses.replace(TIMESTAMP_VIDEO_DEFAULTS, min_pixels=1024, max_pixels=8 * 4096)
    decoded = decode_video(clip.data, cfg, VideoOptions(fps=1.0))
    processor = ref.timestamp_processor(size={"shortest_edge": 1024, "longest_edge": 8 * 4096})
    theirs, grid, _ = ref.run_video_processor(processor, frames, metadata, fps=1.0)
    assert torch.equal(decoded.pixel_values, theirs) and list(decoded.plan.grid) == grid[0].tolist()
    assert plan_video_bytes(clip.data, cfg, VideoOptions(fps=1.0)) == (decoded.header, decoded.plan)


def test_a_clip_too_short_to_sample_is_bad_media():
    one_frame = write_clip(1, 10, 64, 48).data
    with pytest.raises(VideoDecodeError, match="fewer than the temporal patch"):
        plan_video_bytes(one_frame, TIMESTAMP_VIDEO_DEFAULTS)


@pytest.mark.parametrize("size", [(64, 96), (224, 392), (32, 64), (120, 392), (240, 200)])
def test_the_device_resize_stays_within_two_levels_of_the_reference(size):
    # The path for devices without torch's uint8 kernel, run here on the CPU
    # against that kernel (the reference): measured at most 2 levels, under 1%
    # of values off at all, on noise (the worst case for overshoot).
    frames = torch.randint(0, 256, (4, 3, 120, 200), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    diff = (resize_frames_two_pass(frames, *size).int() - resize_frames(frames, *size).int()).abs()
    assert diff.max() <= 2 and (diff > 0).float().mean() < 0.01


def test_the_clip_budget_counts_frames_in_the_area():
    # 8 frames of 640x480 under a budget of 8 frames x 256 tokens' area: each
    # frame gets about 256 tokens' worth, not the whole budget.
    height, width = clip_smart_resize(8, 480, 640, 2, 32, 4096, 8 * 256 * 32 * 32)
    assert (height // 32) * (width // 32) <= 256 and height * width > 200 * 32 * 32
    with pytest.raises(ValueError, match="fewer than the temporal patch"):
        clip_smart_resize(1, 480, 640, 2, 32, 4096, 10**9)


def test_a_one_frame_clip_fails_as_in_the_reference():
    one = dataclasses.make_dataclass("Header", ["total_frames", "fps", "height", "width"])(1, 10.0, 48, 64)
    with pytest.raises(ValueError, match="too short"):
        plan_video(one, INTERVAL_VIDEO_DEFAULTS, VideoOptions(fps=2.0))
    with pytest.raises(ValueError, match="fewer than the temporal patch"):
        plan_video(one, TIMESTAMP_VIDEO_DEFAULTS)
    # Unsampled, the grid-interval variant pads the one frame to a temporal patch.
    assert plan_video(one, INTERVAL_VIDEO_DEFAULTS).grid[0] == 1


def test_preprocess_refuses_frames_the_plan_did_not_ask_for(clips):
    clip, header, _, frames = clips["24fps-3s-200x120"]
    plan = plan_video(header, TIMESTAMP_VIDEO_DEFAULTS)
    with pytest.raises(ValueError, match="the plan samples"):
        preprocess_video(frames[:3], plan, TIMESTAMP_VIDEO_DEFAULTS)
    picked = frames[list(plan.frame_indices)]
    with pytest.raises(ValueError, match="the header said 200x120"):
        preprocess_video(np.ascontiguousarray(picked[:, :100]), plan, TIMESTAMP_VIDEO_DEFAULTS)


# ---------------------------------------------------------------- (e) time: seconds per step, timestamps

@pytest.mark.parametrize("clip_name, options", [("24fps-3s-200x120", VideoOptions(fps=2.0)),
                                                ("29.97fps-3s-96x64", VideoOptions(num_frames=9)),
                                                ("10fps-0.5s-64x48", None)])
def test_seconds_per_grid_step_equal_the_reference_processor(clips, tmp_path, clip_name, options):
    clip, header, metadata, frames = clips[clip_name]
    video_processor = ref.interval_processor(size={"shortest_edge": 1024, "longest_edge": 4096})
    processor = ref.interval_prompt_processor(ref.tokenizer_dir(tmp_path), video_processor)
    cfg = dataclasses.replace(INTERVAL_VIDEO_DEFAULTS, min_pixels=1024, max_pixels=4096)
    plan = plan_video(header, cfg, options)
    out = processor(text=["<|vision_start|><|video_pad|><|vision_end|>"], videos=[frames],
                    video_metadata=[dict(metadata)], **reference_call(cfg, options))
    assert out["second_per_grid_ts"] == [plan.seconds_per_step]  # Python floats, compared exactly
    assert out["input_ids"][0].count(processor.video_token_id) == plan.num_tokens


@pytest.mark.parametrize("clip_name, options", [("30fps-7s-64x48", None),
                                                ("29.97fps-3s-96x64", VideoOptions(num_frames=7)),
                                                ("24fps-3s-200x120", VideoOptions(fps=0.9))])
def test_timestamps_and_their_text_equal_the_reference_processor(clips, tmp_path, clip_name, options):
    clip, header, metadata, frames = clips[clip_name]
    video_processor = ref.timestamp_processor(size={"shortest_edge": 1024, "longest_edge": 8 * 4096})
    processor = ref.timestamp_prompt_processor(ref.tokenizer_dir(tmp_path), video_processor)
    cfg = dataclasses.replace(TIMESTAMP_VIDEO_DEFAULTS, min_pixels=1024, max_pixels=8 * 4096)
    plan = plan_video(header, cfg, options)
    call = reference_call(cfg, options)

    assert list(plan.timestamps) == processor._calculate_timestamps(list(plan.frame_indices), header.fps, 2)
    video_inputs = video_processor(videos=[frames], video_metadata=[dict(metadata)], return_metadata=True, **call)
    expansion = timestamp_prompt(plan, *ref.SPECIAL)
    assert expansion == processor.replace_video_token(video_inputs, video_idx=0)
    assert expansion.count(timestamp_label(plan.timestamps[0])) >= 1 and expansion.startswith("<0.")

    text = "Watch <|vision_start|><|video_pad|><|vision_end|> now"
    out = processor(text=[text], videos=[frames], video_metadata=[dict(metadata)], return_tensors="pt", **call)
    # The template's own start/end pair gives way to the per-patch pairs (transformers >= 5.25).
    expected = processor.tokenizer(text.replace("<|vision_start|><|video_pad|><|vision_end|>", expansion))["input_ids"]
    assert out["input_ids"][0].tolist() == expected
    # The model splits the clip's grid into one per temporal patch, to sit between the timestamps.
    split = torch.repeat_interleave(out["video_grid_thw"], out["video_grid_thw"][:, 0], dim=0)
    split[:, 0] = 1
    assert [tuple(g) for g in split.tolist()] == list(plan.frame_grids)
