"""NVIDIA DALI video backend: NVDEC decode of the planned frames, GPU resize.

On CUDA, `decoders.video` ("mixed": FFmpeg demuxes on the CPU, NVDEC decodes)
returns exactly the frames a clip's plan samples, as RGB uint8 on the GPU;
torch reads them in place (DLPack) and resizes, normalises and patchifies
them there with `preprocess_video`, whose GPU resize is the two-pass float
form of the reference's CPU kernel. On the CPU the same calls run on DALI's
CPU decoder, which in this DALI handles VP8, VP9 and MJPEG only.

The plan is the reference's, read from the header by PyAV on the CPU, so the
frames and the token counts never depend on the backend. A clip goes to the
reference PyAV path instead when DALI cannot take it: a codec its decoder
lacks here, any DALI error (a truncated clip, say: PyAV then names what is
wrong), or frames of another count or size than the plan's.

Tolerance against the reference (normalised units; one uint8 level is 0.015
with CLIP's std, 0.008 with 0.5): DALI converts YUV to RGB its own way, not
as FFmpeg's swscale does for the reference. On generated VP8/VP9 clips, the
CPU decoder's frames differ from PyAV's by about 3.5 levels on average. The
differences are largest at sharp edges of saturated colour, where the two
upsample chroma differently: up to about 100 levels at single pixels. After
preprocessing, the measured worst is 1.55 max abs and 0.053 mean abs
(tests/test_video_dali.py). CPU_TOLERANCE adds a margin to that. The GPU
adds NVDEC's conversion and the two-pass float resize
(`resize_frames_two_pass`). On the H200 (scripts/gpu_video_check.py, H.264
640x360 and 1280x720 clips, both families' processors, 2026-12-01) the
worst was 1.15 max abs and 0.025 mean abs after preprocessing (frames: up
to 120 levels at single pixels, 1.4-1.5 mean, a bias of +1.8/+0.9/+1.1-1.3
levels in R/G/B: NVDEC's YUV->RGB matrix differs slightly from swscale's);
GPU_TOLERANCE is that with a margin.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from pipeline.media.base import BackendUnavailableError, Tolerance
from pipeline.media.dali_backend import _import_dali, dali_place, stream_handoff
from pipeline.media.dali_backend import unavailable_reason as dali_unavailable_reason
from pipeline.media.video_backend import PyAVVideoBackend, VideoBackend, VideoClip
from pipeline.media.video_cpu import DecodedVideo, plan_video_bytes
from pipeline.media.video_probe import ProbeLimits, VideoDecodeError, VideoHeader
from pipeline.processing.video import VideoPlan, preprocess_video
from pipeline.processing.video_config import VideoProcessorConfig

log = logging.getLogger(__name__)

# PyAV's codec names of what each DALI decoder takes (its documentation, 2.4).
GPU_CODECS = frozenset({"h264", "hevc", "vp8", "vp9", "av1", "mpeg4"})
CPU_CODECS = frozenset({"vp8", "vp9"})
CPU_TOLERANCE = Tolerance(max_abs=2.0, mean_abs=0.08)
GPU_TOLERANCE = Tolerance(max_abs=1.6, mean_abs=0.04)

_Planned = tuple[VideoHeader, VideoPlan]


def unavailable_reason(device: torch.device) -> str | None:
    return dali_unavailable_reason(device)


class DaliVideoBackend(VideoBackend):
    """DALI decode; torch resize, normalise, patchify. See the module docstring."""

    def __init__(self, device: torch.device | str, num_threads: int | None = None) -> None:
        device = torch.device(device)
        reason = unavailable_reason(device)
        if reason is not None:
            raise BackendUnavailableError(f"dali video backend on {device}: {reason}")
        self._ndd, _ = _import_dali()
        self._reference = PyAVVideoBackend("cpu", num_threads)
        self._device, self._stream, self._ctx, self._op_device = dali_place(self._ndd, device, num_threads or 4)
        self._codecs = GPU_CODECS if self._device.type == "cuda" else CPU_CODECS
        self.fallbacks = 0   # clips DALI could have taken that went to PyAV instead

    @property
    def name(self) -> str:
        return "dali"

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tolerance(self) -> Tolerance:
        return GPU_TOLERANCE if self._device.type == "cuda" else CPU_TOLERANCE

    def takes(self, codec: str) -> bool:
        """Whether this device's DALI decoder handles `codec` (PyAV's name)."""
        return codec in self._codecs

    def decode(self, clips: Sequence[VideoClip], cfg: VideoProcessorConfig,
               limits: ProbeLimits = ProbeLimits()) -> list[DecodedVideo | VideoDecodeError]:
        slots: list[Any] = [None] * len(clips)
        planned: dict[int, _Planned] = {}
        for i, clip in enumerate(clips):
            try:
                planned[i] = plan_video_bytes(clip.data, cfg, clip.options, limits)
            except VideoDecodeError as exc:
                slots[i] = exc
        ours = [i for i, (header, _) in planned.items() if self.takes(header.codec)]
        with self._ctx:
            frames = self._decode_frames({i: clips[i].data for i in ours}, planned)
            with stream_handoff(self._stream):
                for i, video in frames.items():
                    header, plan = planned[i]
                    pixel_values, _ = preprocess_video(video, plan, cfg)
                    slots[i] = DecodedVideo(pixel_values, header, plan)
        rest = [i for i in planned if slots[i] is None]
        self.fallbacks += sum(1 for i in rest if i in ours)
        for i, result in zip(rest, self._reference.decode([clips[i] for i in rest], cfg, limits)):
            slots[i] = result if isinstance(result, VideoDecodeError) else DecodedVideo(
                result.pixel_values.to(self._device, non_blocking=True), result.header, result.plan)
        return slots

    # ------------------------------------------------------------ steps

    def _decode_frames(self, data: dict[int, bytes], planned: dict[int, _Planned]) -> dict[int, torch.Tensor]:
        """index -> [N, H, W, 3] uint8 frames, for the clips DALI decoded as
        planned. The batch goes in one call; if it fails, each clip alone,
        so that one bad clip costs only itself a fallback."""
        if not data:
            return {}
        order = list(data)
        try:
            decoded = dict(zip(order, self._run_decoder([data[i] for i in order],
                                                        [planned[i][1] for i in order])))
        except RuntimeError:
            decoded = {}
            for i in order:
                try:
                    decoded[i] = self._run_decoder([data[i]], [planned[i][1]])[0]
                except RuntimeError as exc:
                    log.info("DALI could not decode a clip (%s); PyAV decodes it", str(exc).splitlines()[0])
        return {i: video for i, video in decoded.items() if self._as_planned(video, *planned[i])}

    def _run_decoder(self, blobs: list[bytes], plans: list[VideoPlan]) -> list[torch.Tensor]:
        encoded = self._ndd.as_batch([np.frombuffer(blob, dtype=np.uint8) for blob in blobs])
        frames = self._ndd.as_batch([np.asarray(plan.frame_indices, dtype=np.int32) for plan in plans])
        decoded = self._ndd.decoders.video(encoded, device=self._op_device, frames=frames, pad_mode="none")
        return [tensor.torch() for tensor in decoded.evaluate().tensors]

    @staticmethod
    def _as_planned(video: torch.Tensor, header: VideoHeader, plan: VideoPlan) -> bool:
        expected = (len(plan.frame_indices), header.height, header.width, 3)
        if tuple(video.shape) == expected and video.dtype == torch.uint8:
            return True
        log.warning("DALI decoded frames %s where the plan expects %s; PyAV decodes the clip",
                    tuple(video.shape), expected)
        return False

    def close(self) -> None:
        self._reference.close()


