"""A video request on the CPU: bytes -> header and plan (the proxy's part) ->
decoded, preprocessed frames (the encoder's part), with every failure of the
media itself raised as VideoDecodeError, so it becomes that request's 4xx."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pipeline.media.video_probe import ProbeLimits, VideoDecodeError, VideoHeader, decode_frames, probe_video
from pipeline.processing.video import VideoOptions, VideoPlan, plan_video, preprocess_video
from pipeline.processing.video_config import VideoProcessorConfig


@dataclass(frozen=True)
class DecodedVideo:
    """One clip ready for the vision tower: pixel_values float32
    [grid_t * grid_h * grid_w, patch_dim], rows in the reference's order,
    and the header and plan they came from."""

    pixel_values: torch.Tensor
    header: VideoHeader
    plan: VideoPlan


def plan_video_bytes(data: bytes, cfg: VideoProcessorConfig, options: VideoOptions | None = None,
                     limits: ProbeLimits = ProbeLimits()) -> tuple[VideoHeader, VideoPlan]:
    """Header and plan without decoding a frame: enough for the prompt's placeholders."""
    header = probe_video(data, limits)
    try:
        return header, plan_video(header, cfg, options)
    except ValueError as exc:  # too short to sample, extreme aspect ratio, too few frames asked for
        raise VideoDecodeError(str(exc)) from None


def decode_video(data: bytes, cfg: VideoProcessorConfig, options: VideoOptions | None = None,
                 limits: ProbeLimits = ProbeLimits()) -> DecodedVideo:
    """Probe, plan, decode the planned frames and preprocess them."""
    header, plan = plan_video_bytes(data, cfg, options, limits)
    frames = decode_frames(data, plan.frame_indices, header.total_frames)
    try:
        pixel_values, _ = preprocess_video(frames, plan, cfg)
    except ValueError as exc:  # decoded frames of another size than the header states
        raise VideoDecodeError(str(exc)) from None
    return DecodedVideo(pixel_values, header, plan)
