"""Settings of the smart-resize patch video processor, read from a checkpoint.

The reference has two variants of one algorithm; they differ in how frames
are picked, how the pixel budget is counted and how time reaches the model.
Those differences are data here (`VideoRules`), never branches on a family
name: a model family picks the preset its reference processor equals
(`INTERVAL_VIDEO_DEFAULTS` or `TIMESTAMP_VIDEO_DEFAULTS`), and a checkpoint's
saved video processor settings override the preset's, read as the reference
reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

# Shared validation and JSON reading: one definition of what a valid setting is.
from pipeline.processing.image_config import (
    CHANNELS, FIXED_STEPS, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, PREPROCESSOR_FILE, PROCESSOR_FILE,
    _channel_values, _check_int, _check_number, _read_json_object,
)

VIDEO_PREPROCESSOR_FILE = "video_preprocessor_config.json"
# Bumped whenever the pixels this code produces change for the same settings.
ALGORITHM_VERSION = "smart-resize-video-patches/v1"
HALF = (0.5, 0.5, 0.5)
SAMPLINGS = ("stride", "linspace")
BUDGETS = ("per_frame", "per_clip")
TIME_ENCODINGS = ("grid_interval", "timestamp_text")
# Settings whose JSON null means "not set" in the reference (it then samples differently).
_NULLABLE = ("fps", "num_frames")
_PLAIN_SETTINGS = ("patch_size", "temporal_patch_size", "merge_size", "image_mean", "image_std",
                   "rescale_factor", "min_frames", "max_frames", "max_video_tokens")


@dataclass(frozen=True)
class VideoRules:
    """Where the two reference variants differ.

    frame_sampling: "stride" takes a frame count from fps, clamps it to
      [min_frames, max_frames] and the clip, floors it to a multiple of the
      temporal patch, then steps through the clip at total/count;
      "linspace" truncates total/fps*requested, clamps it, does not round it
      to the temporal patch, and spreads it evenly over [0, total - 1].
    pixel_budget: "per_frame" bounds each frame's area by min/max pixels;
      "per_clip" bounds the sampled frames times the area, and first scales
      frames narrower than one merged token up to it.
    time_encoding: "grid_interval" hands the model seconds per temporal grid
      step; "timestamp_text" writes "<t seconds>" before each temporal patch
      in the prompt, each patch a placeholder run of its own.
    legacy_pixel_keys: top-level min_pixels/max_pixels override `size` (when
      False the reference ignores them).
    """

    frame_sampling: str
    pixel_budget: str
    time_encoding: str
    legacy_pixel_keys: bool

    def __post_init__(self) -> None:
        for name, allowed in (("frame_sampling", SAMPLINGS), ("pixel_budget", BUDGETS),
                              ("time_encoding", TIME_ENCODINGS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class VideoProcessorConfig:
    """Settings of the video processor; validated on construction.

    min_pixels/max_pixels bound the resized area (per frame or per clip, see
    `rules.pixel_budget`). sample_frames with fps/num_frames is the
    checkpoint's default sampling; a request's own fps or num_frames always
    samples (as the reference's chat template path does).
    """

    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    rescale_factor: float
    sample_frames: bool
    fps: float | None
    num_frames: int | None
    min_frames: int
    max_frames: int
    cap_pixels_per_frame: bool
    max_video_tokens: int
    rules: VideoRules

    def __post_init__(self) -> None:
        _check_int("patch_size", self.patch_size, 1, 1024)
        _check_int("temporal_patch_size", self.temporal_patch_size, 1, 64)
        _check_int("merge_size", self.merge_size, 1, 64)
        _check_int("min_pixels", self.min_pixels, 1, 2**48)
        _check_int("max_pixels", self.max_pixels, 1, 2**48)
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels ({self.min_pixels}) must be <= max_pixels ({self.max_pixels})")
        object.__setattr__(self, "image_mean", _channel_values("image_mean", self.image_mean, False))
        object.__setattr__(self, "image_std", _channel_values("image_std", self.image_std, True))
        object.__setattr__(self, "rescale_factor", _check_number("rescale_factor", self.rescale_factor, True))
        if not isinstance(self.sample_frames, bool) or not isinstance(self.cap_pixels_per_frame, bool):
            raise ValueError("sample_frames and cap_pixels_per_frame must be true or false")
        if self.fps is not None:
            object.__setattr__(self, "fps", _check_number("fps", self.fps, True))
        if self.num_frames is not None:
            _check_int("num_frames", self.num_frames, 1, 1_000_000)
        if self.fps is not None and self.num_frames is not None:
            raise ValueError(f"fps ({self.fps}) and num_frames ({self.num_frames}) are exclusive; set one")
        _check_int("min_frames", self.min_frames, 1, 1_000_000)
        _check_int("max_frames", self.max_frames, self.min_frames, 1_000_000)
        _check_int("max_video_tokens", self.max_video_tokens, 1, 2**40)
        if not isinstance(self.rules, VideoRules):
            raise ValueError(f"rules must be a VideoRules, got {type(self.rules).__name__}")
        if (self.sample_frames and self.rules.frame_sampling == "stride"
                and self.fps is None and self.num_frames is None):
            # The reference fails on this combination; refuse it at start-up instead.
            raise ValueError("sample_frames with stride sampling needs fps or num_frames")

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this: one merged token covers factor x factor pixels."""
        return self.patch_size * self.merge_size

    @property
    def patch_dim(self) -> int:
        """Length of one row of pixel_values."""
        return CHANNELS * self.temporal_patch_size * self.patch_size * self.patch_size

    def settings_key(self) -> str:
        """A stable string of every setting, to salt content hashes of processed videos."""
        parts = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)]
        return ALGORITHM_VERSION + "|" + "|".join(parts)

    @classmethod
    def from_checkpoint(cls, model_dir: Path, defaults: VideoProcessorConfig) -> VideoProcessorConfig:
        """`defaults` (the family's preset) with the folder's saved settings over them."""
        found = read_video_settings(Path(model_dir))
        if found is None:
            return defaults
        raw, origin = found
        return replace(defaults, **_overrides_from_json(raw, origin, defaults.rules))


def read_video_settings(model_dir: Path) -> tuple[dict[str, Any], str] | None:
    """(video processor settings, where they came from), or None when the folder has none.

    The reference's order: the `video_processor` entry of processor_config.json
    (a transformers 5 save), else video_preprocessor_config.json, else the
    image processor's preprocessor_config.json (checkpoints that ship only
    that file configure their video processor through it).
    """
    combined = model_dir / PROCESSOR_FILE
    if combined.is_file():
        nested = _read_json_object(combined).get("video_processor")
        if nested is not None:
            if not isinstance(nested, dict):
                raise ValueError(f"{combined}: video_processor must be an object, got {nested!r}")
            return nested, f"{combined} (video_processor)"
    for name in (VIDEO_PREPROCESSOR_FILE, PREPROCESSOR_FILE):
        path = model_dir / name
        if path.is_file():
            return _read_json_object(path), str(path)
    return None


def _overrides_from_json(raw: dict[str, Any], origin: str, rules: VideoRules) -> dict[str, Any]:
    for key, expected in FIXED_STEPS:
        if key in raw and raw[key] != expected:
            raise ValueError(f"{origin}: {key}={raw[key]!r} is not supported; only {expected!r} is")
    out: dict[str, Any] = _pixels_from_json(raw, origin, rules)
    for name in _PLAIN_SETTINGS:
        if raw.get(name) is not None:
            out[name] = raw[name]
    for name in _NULLABLE:
        if name in raw:
            out[name] = raw[name]
    # For these two the reference reads a JSON null as false.
    for key, name in (("do_sample_frames", "sample_frames"), ("cap_pixels_per_frame", "cap_pixels_per_frame")):
        if key in raw:
            out[name] = False if raw[key] is None else raw[key]
    return out


def _pixels_from_json(raw: dict[str, Any], origin: str, rules: VideoRules) -> dict[str, Any]:
    """min_pixels/max_pixels from `size` and, where the rules say so, the legacy keys (which win)."""
    out: dict[str, Any] = {}
    size = raw.get("size")
    if size is not None:
        if not isinstance(size, dict):
            raise ValueError(f"{origin}: size must be an object with shortest_edge and longest_edge, "
                             f"got {size!r}")
        for key, name in (("shortest_edge", "min_pixels"), ("longest_edge", "max_pixels")):
            if size.get(key) is not None:
                out[name] = size[key]
    if rules.legacy_pixel_keys:
        for legacy in ("min_pixels", "max_pixels"):
            if raw.get(legacy) is not None:
                out[legacy] = raw[legacy]
    if size is not None and len(out) < 2:
        raise ValueError(f"{origin}: size must contain shortest_edge and longest_edge, got {size!r}")
    return out


INTERVAL_RULES = VideoRules(frame_sampling="stride", pixel_budget="per_frame",
                            time_encoding="grid_interval", legacy_pixel_keys=True)
TIMESTAMP_RULES = VideoRules(frame_sampling="linspace", pixel_budget="per_clip",
                             time_encoding="timestamp_text", legacy_pixel_keys=False)

# The reference class defaults of the variant whose model takes seconds per
# temporal grid step: 14-pixel patches, CLIP normalisation, 128..768 merged
# tokens' area per frame, every frame unless a request asks for fps/num_frames.
INTERVAL_VIDEO_DEFAULTS = VideoProcessorConfig(
    patch_size=14, temporal_patch_size=2, merge_size=2, min_pixels=128 * 28 * 28,
    max_pixels=768 * 28 * 28, image_mean=OPENAI_CLIP_MEAN, image_std=OPENAI_CLIP_STD,
    rescale_factor=1 / 255, sample_frames=False, fps=None, num_frames=None, min_frames=4,
    max_frames=768, cap_pixels_per_frame=False, max_video_tokens=128000, rules=INTERVAL_RULES)

# The reference class defaults of the variant that writes timestamps into the
# prompt: 16-pixel patches, mean and std 0.5, 128..768 merged tokens' area per
# clip, 2 frames a second, 4..768 frames.
TIMESTAMP_VIDEO_DEFAULTS = VideoProcessorConfig(
    patch_size=16, temporal_patch_size=2, merge_size=2, min_pixels=128 * 32 * 32,
    max_pixels=768 * 32 * 32, image_mean=HALF, image_std=HALF, rescale_factor=1 / 255,
    sample_frames=True, fps=2.0, num_frames=None, min_frames=4, max_frames=768,
    cap_pixels_per_frame=False, max_video_tokens=768, rules=TIMESTAMP_RULES)
