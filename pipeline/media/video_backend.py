"""The video side of the media backends: clips in, vision-tower input out.

A video backend decodes the frames a clip's plan samples and preprocesses
them as the family's reference video processor does. The plan always comes
from the container header, read on the CPU by PyAV (`plan_video_bytes`), so
every backend samples the same frames and the proxy's placeholder counts
hold whichever backend an encoder runs. Backends differ only in who decodes
and resizes: PyAV and torch's CPU kernels (the exact reference), or NVDEC
and the GPU (DALI).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from pipeline.media.base import Backend
from pipeline.media.video_cpu import DecodedVideo, decode_video
from pipeline.media.video_probe import ProbeLimits, VideoDecodeError
from pipeline.processing.video import VideoOptions
from pipeline.processing.video_config import VideoProcessorConfig


@dataclass(frozen=True, slots=True)
class VideoClip:
    """One clip to decode: its bytes and the request's own sampling (None: the
    checkpoint's defaults)."""

    data: bytes
    options: VideoOptions | None = None


class VideoBackend(Backend):
    """Decodes and preprocesses batches of clips.

    Contract (as for image backends):
    - `decode` returns one slot per clip, in order: a DecodedVideo whose
      pixel_values lie on `device`, or the VideoDecodeError that this clip
      alone caused. Bad clips never fail the others, nor later batches.
    - Headers are checked against `limits` before any frame is decoded.
    - On a CUDA device the outputs are ordered on the caller's current stream.
    - Anything else raised is a backend fault, not bad media.
    - A backend is used from one thread at a time; `close` releases it.
    """

    @abstractmethod
    def decode(self, clips: Sequence[VideoClip], cfg: VideoProcessorConfig,
               limits: ProbeLimits = ProbeLimits()) -> list[DecodedVideo | VideoDecodeError]:
        """Decode and preprocess `clips`; see the class contract."""


def decode_or_error(clip: VideoClip, cfg: VideoProcessorConfig,
                    limits: ProbeLimits) -> DecodedVideo | VideoDecodeError:
    """The reference path for one clip, its media error as a value."""
    try:
        return decode_video(clip.data, cfg, clip.options, limits)
    except VideoDecodeError as exc:
        return exc


class PyAVVideoBackend(VideoBackend):
    """PyAV decode and torch's CPU resize: bit-exact with the reference's
    video processors. Clips of one batch decode in parallel threads (PyAV
    and torch release the GIL while they work)."""

    def __init__(self, device: torch.device | str = "cpu", num_threads: int | None = None) -> None:
        self._device = torch.device(device)
        self._pool = ThreadPoolExecutor(max_workers=num_threads or 4, thread_name_prefix="pyav")

    @property
    def name(self) -> str:
        return "pyav"

    @property
    def thread_safe(self) -> bool:
        return True   # its pool takes work from any thread; each clip is its own container

    @property
    def device(self) -> torch.device:
        return self._device

    def decode(self, clips: Sequence[VideoClip], cfg: VideoProcessorConfig,
               limits: ProbeLimits = ProbeLimits()) -> list[DecodedVideo | VideoDecodeError]:
        results = list(self._pool.map(lambda clip: decode_or_error(clip, cfg, limits), clips))
        if self._device.type == "cpu":
            return results
        return [r if isinstance(r, VideoDecodeError) else
                DecodedVideo(r.pixel_values.to(self._device, non_blocking=True), r.header, r.plan)
                for r in results]

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def pyav_unavailable_reason(device: torch.device) -> str | None:
    if device.type == "cuda" and not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return None
