"""The media backend interface: raw image bytes in, vision-tower input out."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from pipeline.processing.image import ImageDecodeError, ImageProcessorConfig


class BackendUnavailableError(RuntimeError):
    """A named backend cannot run here; the message says what is missing."""


@dataclass(frozen=True)
class Tolerance:
    """How far a backend's pixel_values may lie from the reference's, in
    normalised units ((x / 255 - mean) / std; one uint8 level is about 0.015).
    The mean is over all values of one image; (0, 0) means bit-exact."""

    max_abs: float
    mean_abs: float

    @staticmethod
    def measure(ours: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
        """(max abs, mean abs) difference; shapes must match."""
        if ours.shape != reference.shape:
            raise ValueError(f"shape mismatch: {tuple(ours.shape)} vs {tuple(reference.shape)}")
        if ours.numel() == 0:
            return 0.0, 0.0
        diff = (ours.detach().cpu().double() - reference.detach().cpu().double()).abs_()
        return float(diff.max()), float(diff.mean())

    def allows(self, max_abs: float, mean_abs: float) -> bool:
        return max_abs <= self.max_abs and mean_abs <= self.mean_abs


EXACT = Tolerance(0.0, 0.0)


@dataclass(frozen=True)
class DecodedImage:
    """One image ready for the vision tower.

    pixel_values: float32 [grid_h * grid_w, patch_dim] on the backend's device,
    rows in the order `preprocess_images` writes them; grid: (t, grid_h, grid_w)
    in patches; source_size: (height, width) of the encoded image.
    """

    pixel_values: torch.Tensor
    grid: tuple[int, int, int]
    source_size: tuple[int, int]


class Backend(ABC):
    """What image and video backends share: a name, a device, a tolerance,
    and resources released by `close` (or a with-block)."""

    @property
    @abstractmethod
    def name(self) -> str:
        """Registry name ("pillow", "dali", "nvjpeg"; "pyav", "dali")."""

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """Where `pixel_values` are returned."""

    @property
    def thread_safe(self) -> bool:
        """Whether `decode` may be called from several threads at once (an
        aggregated generator decodes several requests' media together)."""
        return False

    @property
    def tolerance(self) -> Tolerance:
        """The largest difference from the reference processor this backend's
        outputs may show (documented per backend, checked by the tests)."""
        return EXACT

    def close(self) -> None:
        """Release threads and device resources; the base holds none."""

    def __enter__(self):
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, device={str(self.device)!r})"


class MediaBackend(Backend):
    """Decodes and preprocesses batches of encoded images.

    Contract:
    - `decode` returns one slot per input blob, in order: a DecodedImage, or the
      ImageDecodeError (with a one-line reason) that this blob alone caused.
      Bad media never fails the other blobs in the batch, nor later batches.
    - The header is checked against `cfg.max_image_pixels` before any pixel is
      decoded (decompression bombs).
    - Outputs live on `device` and belong to the caller; on a CUDA device they
      are ordered on the caller's current stream (no synchronisation needed
      before using them on that stream).
    - TypeError for a non-list or a non-bytes item (a caller bug) fails the
      whole call; anything else raised is a backend fault, not bad media.
    - A backend is used from one thread at a time; `close` releases its worker
      threads and device resources, after which it must not be used.
    """

    @abstractmethod
    def decode(self, blobs: list[bytes],
               cfg: ImageProcessorConfig) -> list[DecodedImage | ImageDecodeError]:
        """Decode and preprocess `blobs`; see the class contract."""
