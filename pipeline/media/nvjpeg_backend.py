"""torchvision nvJPEG backend: batched JPEG decode on the GPU, torch resize.

JPEGs go to `torchvision.io.decode_jpeg(list, device="cuda")` in one batched
call (the hardware JPEG engine for baseline files on A100/H100, nvJPEG's
hybrid path for progressive ones). Everything else (PNG, WebP, GIF, CMYK
JPEG, anything nvJPEG fails on) is decoded by the reference Pillow path on the
CPU and copied over. Each image is then resized on the GPU with torch's
antialiased bicubic (Pillow's kernel, a = -0.5), rounded to uint8 as Pillow
does, and normalised and patchified through the reference's level table.

Tolerance against the reference (normalised units, one uint8 level is about
0.015), measured on an H200 (docs/media.md): nvJPEG upsamples subsampled chroma
(4:2:0, 4:2:2: nearly every camera JPEG) by replication, where libjpeg, and so
Pillow, interpolates ("fancy upsampling"); torchvision offers no switch. Decoded
pixels then differ by 2-5 levels on average and by up to 60-80 levels at sharp
colour edges, while 4:4:4 JPEGs decode bit-exact. The resize adds at most
0.27 / 0.0034 (max / mean). Worst measured: max 1.95, mean 0.065 (small,
upscaled, noisy-chroma images). TOLERANCE bounds that with some headroom. The
DALI backend (fancy upsampling on) is the closer GPU path; "auto" prefers it.

torchvision is imported only when the backend is probed or built: a CPU-only
torch may have no matching torchvision at all.
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np
import torch

from pipeline.media.base import BackendUnavailableError, DecodedImage, MediaBackend, Tolerance
from pipeline.media.patches import normalize_table, patchify, resize_bicubic
from pipeline.media.pillow_backend import DecodePool
from pipeline.media.probe import ImageHeader, probe_batch
from pipeline.media.routing import decode_routed
from pipeline.processing.image import ImageDecodeError, ImageProcessorConfig

TOLERANCE = Tolerance(max_abs=2.5, mean_abs=0.1)
# The torch resize alone (measured 0.27 / 0.0034 on the CPU): what PNGs and
# other Pillow-decoded images may show.
RESIZE_TOLERANCE = Tolerance(max_abs=0.5, mean_abs=0.01)


def _import_torchvision_io() -> Any:
    try:
        return importlib.import_module("torchvision.io")
    # A torchvision built for another torch fails at import with RuntimeError
    # (missing operators) or OSError (unloadable extension), not ImportError.
    except (ImportError, RuntimeError, OSError) as exc:
        raise BackendUnavailableError(
            f"torchvision.io is not importable ({exc}); install the torchvision that "
            f"matches torch {torch.__version__}") from None


def unavailable_reason(device: torch.device) -> str | None:
    if device.type != "cuda":
        return f"nvJPEG decodes on CUDA devices only, not {device.type}"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    try:
        _import_torchvision_io()
    except BackendUnavailableError as exc:
        return str(exc)
    return None


class NvjpegBackend(MediaBackend):
    """nvJPEG decode + torch resize/normalise/patchify on one CUDA device."""

    def __init__(self, device: torch.device | str, num_threads: int | None = None) -> None:
        """num_threads: CPU threads for the images Pillow decodes (PNG, ...)."""
        device = torch.device(device)
        reason = unavailable_reason(device)
        if reason is not None:
            raise BackendUnavailableError(f"nvjpeg backend on {device}: {reason}")
        self._io = _import_torchvision_io()
        index = device.index if device.index is not None else torch.cuda.current_device()
        self._device = torch.device("cuda", index)
        self._tables: dict[ImageProcessorConfig, torch.Tensor] = {}
        self._pool = DecodePool(num_threads)

    @property
    def name(self) -> str:
        return "nvjpeg"

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tolerance(self) -> Tolerance:
        return TOLERANCE

    def decode(self, blobs: list[bytes],
               cfg: ImageProcessorConfig) -> list[DecodedImage | ImageDecodeError]:
        slots: list[Any] = probe_batch(blobs, cfg)
        headers = {i: slot for i, slot in enumerate(slots) if isinstance(slot, ImageHeader)}
        images = decode_routed(blobs, headers, slots, cfg, gpu_decode=self._run_decoder,
                               from_pillow=self._upload, label="nvJPEG", cpu_map=self._pool.map)
        table = self._table(cfg)
        for i, chw in images.items():
            header = headers[i]
            rgb = resize_bicubic(chw, *header.resized)
            slots[i] = DecodedImage(patchify(rgb, cfg, table), header.grid, header.source_size)
        return slots

    def _run_decoder(self, blobs: list[bytes]) -> list[torch.Tensor]:
        """CHW uint8 RGB on the device. torchvision makes the caller's current
        stream wait for its decode stream; EXIF orientation stays unapplied,
        as in the reference."""
        # decode_jpeg reads CPU uint8 tensors; bytearray makes them writable.
        encoded = [torch.frombuffer(bytearray(blob), dtype=torch.uint8) for blob in blobs]
        return self._io.decode_jpeg(encoded, mode=self._io.ImageReadMode.RGB, device=self._device,
                                    apply_exif_orientation=False)

    def _upload(self, rgb: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(rgb).to(self._device).permute(2, 0, 1)

    def close(self) -> None:
        self._pool.close()

    def _table(self, cfg: ImageProcessorConfig) -> torch.Tensor:
        if cfg not in self._tables:
            self._tables[cfg] = normalize_table(cfg, self._device)
        return self._tables[cfg]
