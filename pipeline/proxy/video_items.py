"""A chat request's videos at the proxy: each one's header read and its
frames planned (which frames, the grid, the placeholder counts, the
timestamps) without decoding a pixel, so the prompt is built at once; the
encoders decode. Bad or oversized media is a 4xx naming the video."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.hashing import content_hash, media_salt
from pipeline.media.video_cpu import plan_video_bytes
from pipeline.media.video_probe import VideoDecodeError
from pipeline.processing.video import VideoOptions, VideoPlan, video_settings_key
from pipeline.processing.video_config import VideoProcessorConfig
from pipeline.proxy.api_types import ApiError, ChatCompletionRequest


@dataclass(frozen=True)
class VideoLimits:
    max_frames: int = 768         # sampled frames a video may give the model
    max_seconds: float = 3600.0   # a clip's length


def video_options(req: ChatCompletionRequest) -> VideoOptions | None:
    kwargs = req.mm_processor_kwargs
    if kwargs is None or (kwargs.fps is None and kwargs.num_frames is None):
        return None
    try:
        return VideoOptions(kwargs.fps, kwargs.num_frames)
    except ValueError as exc:
        raise ApiError(f"mm_processor_kwargs: {exc}", param="mm_processor_kwargs") from None


def checked_plan(number: int, data: bytes, cfg: VideoProcessorConfig | None, options: VideoOptions | None,
                 limits: VideoLimits) -> VideoPlan:
    """The video's plan from its header; a 400 for a bad clip or one over the limits."""
    if cfg is None:
        raise ApiError("this model takes no video input", param="messages")
    try:
        header, plan = plan_video_bytes(data, cfg, options)
    except VideoDecodeError as exc:
        raise ApiError(f"video {number}: {exc}", param="messages") from None
    if header.duration > limits.max_seconds:
        raise ApiError(f"video {number}: {header.duration:.1f} s long; at most {limits.max_seconds:g} s",
                       param="messages")
    if len(plan.frame_indices) > limits.max_frames:
        raise ApiError(f"video {number}: {len(plan.frame_indices)} frames sampled; at most {limits.max_frames}"
                       " (ask for fewer with mm_processor_kwargs fps or num_frames)", param="messages")
    return plan


def video_key(data: bytes, model_id: str, cfg: VideoProcessorConfig, options: VideoOptions | None) -> str:
    """Its salted content hash: the encoder computes the same from the job."""
    return content_hash(data, media_salt(model_id, video_settings_key(cfg, options), "video"))
