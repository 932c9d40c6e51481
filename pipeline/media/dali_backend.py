"""NVIDIA DALI backend (dynamic mode, `nvidia.dali.experimental.dynamic`).

On CUDA: JPEGs are decoded by nvJPEG (DALI's "mixed" decoder, with the A100/
H100 hardware JPEG engine where present), every image is resized on the GPU to
its own smart_resize size in one batched DALI call (cubic, antialiased), and
torch reads the result in place through DLPack (no copy) to normalise and
patchify it.
With a CPU device the same calls run on DALI's CPU operators (libjpeg-turbo
decode, CPU resize).

Only complete grey/YCbCr JPEGs go to DALI's decoder. Everything else (PNG,
WebP, GIF, CMYK JPEG, anything DALI fails on) is decoded by the reference
Pillow path, which also composites alpha onto white as the reference does and
names what is wrong with corrupt files; its pixels then take the same DALI
resize. EXIF orientation is not applied, as in the reference.

Tolerance against the reference (normalised units, i.e. after (x/255-mean)/std;
one uint8 level is 0.014-0.015). DALI's CPU JPEG decode (libjpeg-turbo, fancy
upsampling on) is bit-identical to Pillow's, so in CPU mode only the resampler
differs: measured worst max abs 0.27 (isolated pixels at hard edges of tiny
upscaled images), worst mean abs 0.0037, identity-size images exact (see
docs/media.md). CPU_TOLERANCE is about twice that. In CUDA mode nvJPEG decodes
(fancy upsampling requested, to match libjpeg) and DALI's GPU resampler runs in
float: measured on an H100 (scripts/gpu_dali_media.sh), worst max abs 0.27 and
worst mean abs 0.0041 over the same 36 images, so the same bound holds.
"""

from __future__ import annotations

import importlib
import io
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from PIL import Image

from pipeline.media.base import BackendUnavailableError, DecodedImage, MediaBackend, Tolerance
from pipeline.media.patches import normalize_table, patchify
from pipeline.media.pillow_backend import DecodePool
from pipeline.media.probe import ImageHeader, probe_batch
from pipeline.media.routing import decode_routed
from pipeline.processing.image import ImageDecodeError, ImageProcessorConfig


PIP_PACKAGE = "nvidia-dali-cuda130"
# CPU mode: measured worst 0.27 / 0.0037 (docs/media.md), bound about 2x that.
CPU_TOLERANCE = Tolerance(max_abs=0.5, mean_abs=0.01)
# CUDA mode adds nvJPEG's IDCT and the GPU resampler's float rounding: measured
# worst 0.27 / 0.0041 on an H100 (docs/media.md), within the CPU mode's bound.
GPU_TOLERANCE = Tolerance(max_abs=0.5, mean_abs=0.01)


def _import_dali() -> tuple[Any, Any]:
    """(ndd, types), or BackendUnavailableError naming the package to install."""
    try:
        ndd = importlib.import_module("nvidia.dali.experimental.dynamic")
        types = importlib.import_module("nvidia.dali.types")
    except ImportError as exc:
        raise BackendUnavailableError(
            f"NVIDIA DALI is not importable ({exc}); install it with `pip install {PIP_PACKAGE}`"
        ) from None
    return ndd, types


def unavailable_reason(device: torch.device) -> str | None:
    if device.type not in ("cpu", "cuda"):
        return f"DALI runs on cpu or cuda devices, not {device.type}"
    if device.type == "cuda" and not torch.cuda.is_available():
        return "torch sees no CUDA device"
    try:
        _import_dali()
    except BackendUnavailableError as exc:
        return str(exc)
    return None


def dali_place(ndd: Any, device: torch.device,
               num_threads: int) -> tuple[torch.device, torch.cuda.Stream | None, Any, str]:
    """Where a DALI backend runs: (device, DALI's own stream or None, the
    evaluation context, the operators' device name)."""
    if device.type != "cuda":
        return torch.device("cpu"), None, ndd.EvalContext(num_threads=num_threads), "cpu"
    index = device.index if device.index is not None else torch.cuda.current_device()
    # DALI works on its own stream; decode() orders it against the caller's
    # current stream in both directions (see stream_handoff).
    stream = torch.cuda.Stream(torch.device("cuda", index))
    ctx = ndd.EvalContext(num_threads=num_threads, device_id=index, cuda_stream=stream)
    return torch.device("cuda", index), stream, ctx, "gpu"  # "gpu": dynamic mode's name for "mixed"


class DaliBackend(MediaBackend):
    """DALI decode + resize; torch normalise + patchify. See the module docstring."""

    def __init__(self, device: torch.device | str, num_threads: int | None = None) -> None:
        """num_threads: DALI's worker threads, and as many for the images Pillow decodes."""
        device = torch.device(device)
        reason = unavailable_reason(device)
        if reason is not None:
            raise BackendUnavailableError(f"dali backend on {device}: {reason}")
        self._pool = DecodePool(num_threads)
        num_threads = self._pool.num_threads
        self._ndd, self._types = _import_dali()
        self._tables: dict[ImageProcessorConfig, torch.Tensor] = {}
        self._device, self._stream, self._ctx, self._op_device = dali_place(self._ndd, device, num_threads)
        self._warm_up()

    @property
    def name(self) -> str:
        return "dali"

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tolerance(self) -> Tolerance:
        return GPU_TOLERANCE if self._device.type == "cuda" else CPU_TOLERANCE

    def decode(self, blobs: list[bytes],
               cfg: ImageProcessorConfig) -> list[DecodedImage | ImageDecodeError]:
        slots: list[Any] = probe_batch(blobs, cfg)
        headers = {i: slot for i, slot in enumerate(slots) if isinstance(slot, ImageHeader)}
        with self._ctx:
            images = decode_routed(blobs, headers, slots, cfg, gpu_decode=self._run_decoder,
                                   from_pillow=lambda rgb: rgb, label="DALI", cpu_map=self._pool.map)
            resized = self._resize(images, headers)
            table = self._table(cfg)
            with stream_handoff(self._stream):
                for i, rgb in resized.items():
                    header = headers[i]
                    slots[i] = DecodedImage(patchify(rgb, cfg, table), header.grid, header.source_size)
        return slots

    # ------------------------------------------------------------ steps

    def _run_decoder(self, blobs: list[bytes]) -> list[Any]:
        """HWC uint8 RGB DALI tensors, on the GPU in CUDA mode."""
        encoded = self._ndd.as_batch([np.frombuffer(blob, dtype=np.uint8) for blob in blobs])
        decoded = self._ndd.decoders.image(
            encoded, device=self._op_device, output_type=self._types.RGB,
            adjust_orientation=False,  # the reference ignores EXIF orientation
            jpeg_fancy_upsampling=True)  # libjpeg's (and so Pillow's) chroma upsampling
        return list(decoded.evaluate().tensors)

    def _resize(self, images: dict[int, Any], headers: dict[int, ImageHeader]) -> dict[int, torch.Tensor]:
        """index -> resized HWC uint8 torch tensor on the backend's device."""
        from_dali = [i for i in images if not isinstance(images[i], np.ndarray)]
        from_pillow = [i for i in images if isinstance(images[i], np.ndarray)]
        out: dict[int, torch.Tensor] = {}
        for group in (from_dali, from_pillow):
            if not group:
                continue
            batch = self._ndd.as_batch([images[i] for i in group], layout="HWC",
                                       device=self._op_device)
            sizes = self._ndd.as_batch([np.array(headers[i].resized, dtype=np.float32)
                                        for i in group])
            resized = self._ndd.resize(batch, size=sizes, interp_type=self._types.INTERP_CUBIC,
                                       antialias=True).evaluate()
            out.update(zip(group, (tensor.torch() for tensor in resized.tensors)))
        return out

    def close(self) -> None:
        self._pool.close()

    # ------------------------------------------------------------ helpers

    def _table(self, cfg: ImageProcessorConfig) -> torch.Tensor:
        if cfg not in self._tables:
            self._tables[cfg] = normalize_table(cfg, self._device)
        return self._tables[cfg]

    def _warm_up(self) -> None:
        """Build the operators once, so a broken install (say, a CUDA driver too
        old for the wheel) fails here rather than on the first request. The
        decoder is called directly: decode() would hide its failure behind Pillow."""
        buf = io.BytesIO()
        Image.new("RGB", (64, 48), (120, 30, 200)).save(buf, format="JPEG")
        try:
            with self._ctx:
                self._run_decoder([buf.getvalue()])
        except RuntimeError as exc:
            raise BackendUnavailableError(
                f"DALI cannot decode a test JPEG on {self._device}: {exc}") from None
        result = self.decode([buf.getvalue()], ImageProcessorConfig())[0]
        if isinstance(result, ImageDecodeError):
            raise BackendUnavailableError(f"DALI cannot process a test JPEG: {result}")


@contextmanager
def stream_handoff(dali_stream: torch.cuda.Stream | None) -> Iterator[None]:
    """Order torch work on the caller's stream after DALI's, and DALI's next
    work after torch's: the tensors torch reads are DALI's own buffers (DLPack),
    which DALI may reuse once they are released."""
    if dali_stream is None:
        yield
        return
    current = torch.cuda.current_stream(dali_stream.device)
    current.wait_stream(dali_stream)
    yield
    dali_stream.wait_stream(current)
