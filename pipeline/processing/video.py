"""Smart-resize patch video preprocessing: header -> plan; decoded frames -> patches.

Equal to the reference video processors (transformers' torchvision-backed
ones; they have no PIL path). Everything the prompt needs (which frames, the
grid, the placeholder counts, seconds per temporal step, the timestamps)
comes from the container header alone: `plan_video` needs the frame count,
frame rate and size, never a decoded pixel. Decoded frames then go through
`preprocess_video` with the same plan. The settings and the two variants'
differences are video_config.py's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F

from pipeline.processing.image import MAX_ASPECT_RATIO, smart_resize
from pipeline.processing.video_config import CHANNELS, VideoProcessorConfig

__all__ = ["VideoOptions", "VideoPlan", "VideoSource", "clip_smart_resize", "plan_video", "preprocess_video",
           "resize_frames", "resize_frames_two_pass", "sample_frame_indices", "timestamp_label", "timestamp_prompt",
           "video_settings_key", "video_token_count"]


class VideoSource(Protocol):
    """What a plan reads from a container header (pipeline.media.video_probe.VideoHeader)."""

    total_frames: int
    fps: float
    height: int
    width: int


@dataclass(frozen=True)
class VideoOptions:
    """A request's own sampling, overriding the checkpoint's: frames per second
    or a frame count (exclusive, as in the reference). Either one samples."""

    fps: float | None = None
    num_frames: int | None = None

    def __post_init__(self) -> None:
        if self.fps is not None and self.num_frames is not None:
            raise ValueError("fps and num_frames are exclusive; give one")
        if self.fps is not None and (isinstance(self.fps, bool) or not isinstance(self.fps, (int, float))
                                     or not math.isfinite(self.fps) or self.fps <= 0):
            raise ValueError(f"fps must be a finite number > 0, got {self.fps!r}")
        if self.num_frames is not None and (isinstance(self.num_frames, bool)
                                            or not isinstance(self.num_frames, int) or self.num_frames < 1):
            raise ValueError(f"num_frames must be an integer >= 1, got {self.num_frames!r}")


@dataclass(frozen=True)
class VideoPlan:
    """Everything about one clip that is known before decoding.

    frame_indices: source frames to decode, in order (they may repeat);
    source_size: (height, width) of the frames, from the header;
    resized: (height, width) they are resized to;
    grid: (grid_t, grid_h, grid_w) in patches, grid_t after padding the
    frames to a multiple of the temporal patch with the last one;
    tokens_per_step: merged placeholder tokens per temporal patch;
    seconds_per_step: seconds one temporal grid step spans (the model input
    the "grid_interval" variant takes); timestamps: per temporal patch, the
    mean time of its first and last frame (the "timestamp_text" variant's).
    """

    frame_indices: tuple[int, ...]
    source_size: tuple[int, int]
    grid: tuple[int, int, int]
    resized: tuple[int, int]
    tokens_per_step: int
    seconds_per_step: float
    timestamps: tuple[float, ...]

    @property
    def num_tokens(self) -> int:
        """Placeholder tokens for the whole clip."""
        return self.grid[0] * self.tokens_per_step

    @property
    def frame_grids(self) -> tuple[tuple[int, int, int], ...]:
        """One (1, grid_h, grid_w) per temporal patch: the split the timestamped variant's model uses."""
        _, grid_h, grid_w = self.grid
        return ((1, grid_h, grid_w),) * self.grid[0]


# ---------------------------------------------------------------- frame sampling

def _sampling_request(cfg: VideoProcessorConfig,
                      options: VideoOptions | None) -> tuple[bool, float | None, int | None]:
    """(sample?, fps, num_frames): the request's, else the checkpoint's default."""
    if options is not None and (options.fps is not None or options.num_frames is not None):
        return True, options.fps, options.num_frames
    return cfg.sample_frames, cfg.fps, cfg.num_frames


def sample_frame_indices(total_frames: int, video_fps: float, cfg: VideoProcessorConfig,
                         fps: float | None, num_frames: int | None) -> tuple[int, ...]:
    """The reference's `sample_frames` for cfg's variant; ValueError where it would fail."""
    if total_frames < 1:
        raise ValueError(f"a video needs at least one frame, got {total_frames}")
    if cfg.rules.frame_sampling == "linspace":
        return _linspace_indices(total_frames, video_fps, cfg, fps, num_frames)
    return _stride_indices(total_frames, video_fps, cfg, fps, num_frames)


def _stride_indices(total: int, video_fps: float, cfg: VideoProcessorConfig,
                    fps: float | None, num_frames: int | None) -> tuple[int, ...]:
    step = cfg.temporal_patch_size
    if num_frames is not None:
        count = round(num_frames / step) * step
    elif fps is not None:
        most = math.floor(min(cfg.max_frames, total) / step) * step
        wanted = min(max(total / video_fps * fps, cfg.min_frames), most, total)
        count = math.floor(wanted / step) * step
    else:
        return tuple(range(total))
    if count > total:
        raise ValueError(f"cannot sample {count} frames from a video of {total}; ask for fewer")
    if count < 1 and num_frames is not None:
        raise ValueError(f"num_frames={num_frames} rounds to no frames in steps of {step}; ask for at least {step}")
    if count < 1:
        raise ValueError(f"a video of {total} frame(s) is too short to sample in steps of {step} frames")
    # torch.arange exactly as the reference calls it: its float32 steps and its
    # length rule (which sometimes yields one index more than `count`) decide
    # which frames are taken, so the same call is the only way to equal it.
    return tuple(torch.arange(0, total, total / count).int().tolist())


def _linspace_indices(total: int, video_fps: float, cfg: VideoProcessorConfig,
                      fps: float | None, num_frames: int | None) -> tuple[int, ...]:
    if num_frames is None and fps is not None:
        num_frames = int(total / video_fps * fps)
        num_frames = min(max(num_frames, cfg.min_frames), cfg.max_frames, total)
    if num_frames is None:
        num_frames = min(max(total, cfg.min_frames), cfg.max_frames)
    return tuple(np.linspace(0, total - 1, num_frames).round().astype(int).tolist())


# ---------------------------------------------------------------- sizes

def clip_smart_resize(num_frames: int, height: int, width: int, temporal_factor: int, factor: int,
                      min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The per-clip variant's target size: area bounds apply to frames x area,
    and a frame narrower than `factor` is first scaled up to it."""
    if num_frames < temporal_factor:
        raise ValueError(f"{num_frames} sampled frame(s) is fewer than the temporal patch "
                         f"({temporal_factor}); the video is too short")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ValueError(f"video aspect ratio must be at most {MAX_ASPECT_RATIO}:1, got {width}x{height}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def resized_frame_size(num_frames: int, height: int, width: int,
                       cfg: VideoProcessorConfig) -> tuple[int, int]:
    """(height, width) every sampled frame is resized to, for cfg's pixel budget."""
    f, step = cfg.factor, cfg.temporal_patch_size
    max_pixels = cfg.max_pixels
    if cfg.rules.pixel_budget == "per_frame":
        if cfg.cap_pixels_per_frame:
            total_pixels = int(cfg.max_video_tokens * f * f * 0.9)
            max_pixels = max(min(max_pixels, total_pixels * step // num_frames), int(cfg.min_pixels * 1.05))
        return smart_resize(height, width, f, cfg.min_pixels, max_pixels)
    if cfg.cap_pixels_per_frame:
        per_frame = max(min(cfg.max_video_tokens * f * f, max_pixels // num_frames), int(cfg.min_pixels * 1.05))
        max_pixels = per_frame * num_frames
    return clip_smart_resize(num_frames, height, width, step, f, cfg.min_pixels, max_pixels)


# ---------------------------------------------------------------- the plan

def _timestamps(indices: tuple[int, ...], video_fps: float, step: int) -> tuple[float, ...]:
    """Per temporal patch: the mean of its first and last frame's time; the
    indices are padded with the last one as the frames are."""
    padded = list(indices) + [indices[-1]] * (-len(indices) % step)
    times = [index / video_fps for index in padded]
    return tuple((times[i] + times[i + step - 1]) / 2 for i in range(0, len(times), step))


def plan_video(header: VideoSource, cfg: VideoProcessorConfig,
               options: VideoOptions | None = None) -> VideoPlan:
    """The plan for a clip from its header; ValueError for a clip the
    reference cannot process (too short to sample, extreme aspect ratio)."""
    sample, fps, num_frames = _sampling_request(cfg, options)
    if sample:
        indices = sample_frame_indices(header.total_frames, header.fps, cfg, fps, num_frames)
    else:
        indices = tuple(range(header.total_frames))
    if not indices:
        raise ValueError("a video needs at least one frame")
    height, width = resized_frame_size(len(indices), header.height, header.width, cfg)
    step, p = cfg.temporal_patch_size, cfg.patch_size
    grid = (-(-len(indices) // step), height // p, width // p)
    sampled_fps = len(indices) / header.total_frames * header.fps
    return VideoPlan(frame_indices=indices, source_size=(header.height, header.width), grid=grid,
                     resized=(height, width), tokens_per_step=grid[1] * grid[2] // cfg.merge_size**2,
                     seconds_per_step=step / sampled_fps,
                     timestamps=_timestamps(indices, header.fps, step))


def video_token_count(header: VideoSource, cfg: VideoProcessorConfig,
                      options: VideoOptions | None = None) -> int:
    """Placeholder tokens the language model sees for this clip, from its header alone."""
    return plan_video(header, cfg, options).num_tokens


def video_settings_key(cfg: VideoProcessorConfig, options: VideoOptions | None) -> str:
    """Everything that changes a clip's embedding besides its bytes and the
    model: the checkpoint's video settings and the request's own sampling."""
    asked = "" if options is None else f"|fps={options.fps!r}|num_frames={options.num_frames!r}"
    return cfg.settings_key() + asked


def timestamp_label(seconds: float) -> str:
    """The text the reference writes before a temporal patch: "<1.5 seconds>"."""
    return f"<{seconds:.1f} seconds>"


def timestamp_prompt(plan: VideoPlan, video_token: str, start_token: str, end_token: str) -> str:
    """The timestamped variant's expansion of one video placeholder: per
    temporal patch, its label, then start, its placeholder run, end."""
    run = video_token * plan.tokens_per_step
    return "".join(f"{timestamp_label(t)}{start_token}{run}{end_token}" for t in plan.timestamps)


# ---------------------------------------------------------------- pixels

def resize_frames(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[N, C, H, W] uint8 -> [N, C, height, width] uint8, antialiased bicubic.

    On the CPU this is the reference's resize exactly (torchvision hands uint8
    bicubic to torch's own CPU kernel). Other devices have no uint8 kernel;
    see `resize_frames_two_pass`. Same size is no resize.
    """
    if tuple(frames.shape[-2:]) == (height, width):
        return frames
    if frames.device.type == "cpu":
        return F.interpolate(frames, size=(height, width), mode="bicubic", align_corners=False, antialias=True)
    return resize_frames_two_pass(frames, height, width)


def _interpolate_to_uint8(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    resized = F.interpolate(frames.to(torch.float32), size=(height, width), mode="bicubic",
                            align_corners=False, antialias=True)
    return resized.clamp_(0, 255).round_().to(torch.uint8)


def resize_frames_two_pass(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """The CPU kernel's structure on any device: width first, rounded to uint8,
    then height. That kernel works in int16 fixed-point weights, this in
    float32, so results differ by at most a couple of levels (tests measure
    it); one float pass over both axes, as the reference itself does on a GPU,
    differs from the CPU result by up to ~20 levels where bicubic overshoot
    is clipped between the passes."""
    out = frames
    if out.shape[-1] != width:
        out = _interpolate_to_uint8(out, out.shape[-2], width)
    if out.shape[-2] != height:
        out = _interpolate_to_uint8(out, height, width)
    return out


def _normalize(frames: torch.Tensor, cfg: VideoProcessorConfig) -> torch.Tensor:
    """uint8 -> float32 with the reference's fused arithmetic: (x - mean/r) / (std/r)."""
    scale = 1.0 / cfg.rescale_factor
    mean = (torch.tensor(cfg.image_mean, device=frames.device) * scale).view(-1, 1, 1)
    std = (torch.tensor(cfg.image_std, device=frames.device) * scale).view(-1, 1, 1)
    return frames.to(torch.float32).sub_(mean).div_(std)


def _patchify(frames: torch.Tensor, plan: VideoPlan, cfg: VideoProcessorConfig) -> torch.Tensor:
    """[N, C, H, W] float32 -> [grid_t * grid_h * grid_w, patch_dim]; rows are
    temporal-patch major, then merge windows; each row is (C, T, p, p)."""
    step, p, m = cfg.temporal_patch_size, cfg.patch_size, cfg.merge_size
    if pad := -frames.shape[0] % step:
        frames = torch.cat((frames, frames[-1:].expand(pad, -1, -1, -1)))
    grid_t, grid_h, grid_w = plan.grid
    blocks = frames.reshape(grid_t, step, CHANNELS, grid_h // m, m, p, grid_w // m, m, p)
    return blocks.permute(0, 3, 6, 4, 7, 2, 1, 5, 8).reshape(grid_t * grid_h * grid_w, cfg.patch_dim)


def preprocess_video(frames: np.ndarray | torch.Tensor, plan: VideoPlan,
                     cfg: VideoProcessorConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoded frames [N, H, W, 3] uint8 (N = len(plan.frame_indices)) ->
    (pixel_values float32 [grid_t*grid_h*grid_w, patch_dim], grid_thw int64 [1, 3]),
    on the frames' device."""
    video = torch.from_numpy(frames) if isinstance(frames, np.ndarray) else frames
    if video.dtype != torch.uint8 or video.dim() != 4 or video.shape[-1] != CHANNELS:
        raise ValueError(f"frames must be uint8 [N, H, W, 3], got {video.dtype} {tuple(video.shape)}")
    if video.shape[0] != len(plan.frame_indices):
        raise ValueError(f"got {video.shape[0]} frames; the plan samples {len(plan.frame_indices)}")
    if tuple(video.shape[1:3]) != plan.source_size:
        # The resize was chosen for the header's size; other frames would need another one.
        raise ValueError(f"frames are {video.shape[2]}x{video.shape[1]}; the header said "
                         f"{plan.source_size[1]}x{plan.source_size[0]}")
    chw = video.permute(0, 3, 1, 2).contiguous()
    resized = resize_frames(chw, *plan.resized)
    pixel_values = _patchify(_normalize(resized, cfg), plan, cfg)
    return pixel_values, torch.tensor([plan.grid], dtype=torch.int64)
