"""Media backends by name, and the choice "auto" makes: one registry for
image backends, one for video backends.

Each backend registers a factory and an availability check. The check returns
None when the backend can run on a device, else one line saying what is
missing; naming an unavailable backend raises with that line, it never falls
back to another one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pipeline.media.base import BackendUnavailableError, MediaBackend
from pipeline.media.video_backend import VideoBackend

logger = logging.getLogger(__name__)

Factory = Callable[..., Any]
AvailableFn = Callable[[torch.device], "str | None"]


@dataclass(frozen=True)
class _Entry:
    factory: Factory
    available_fn: AvailableFn


class _Registry:
    """Backends of one kind ("media" for images, "video"), and the order
    "auto" tries them in per device type."""

    def __init__(self, kind: str, auto_order: dict[str, tuple[str, ...]]) -> None:
        self.kind = kind
        self.auto_order = auto_order
        self.entries: dict[str, _Entry] = {}

    def register(self, name: str, factory: Factory, available_fn: AvailableFn) -> None:
        if not name or name == "auto":
            raise ValueError(f"invalid backend name {name!r}")
        if name in self.entries:
            raise ValueError(f"{self.kind} backend {name!r} is already registered")
        self.entries[name] = _Entry(factory, available_fn)

    def unavailable_reason(self, name: str, device: torch.device | str) -> str | None:
        _register_builtins()
        if name not in self.entries:
            raise ValueError(f"unknown {self.kind} backend {name!r}; known: auto, {', '.join(self.entries)}")
        return self.entries[name].available_fn(torch.device(device))

    def create(self, name: str, device: torch.device | str, options: dict[str, Any]) -> Any:
        device = torch.device(device)
        if name == "auto":
            return self._create_auto(device, options)
        reason = self.unavailable_reason(name, device)
        if reason is not None:
            raise BackendUnavailableError(f"{self.kind} backend {name!r} is not available on {device}: {reason}")
        backend = self.entries[name].factory(device, **options)
        logger.info("%s backend: %s on %s", self.kind, backend.name, device)
        return backend

    def _create_auto(self, device: torch.device, options: dict[str, Any]) -> Any:
        """The first backend in the auto order that is available and builds;
        the log line names it and why each one before it was skipped."""
        skipped = []
        for name in self.auto_order.get(device.type, ()):
            reason = self.unavailable_reason(name, device)
            if reason is None:
                try:
                    backend = self.entries[name].factory(device, **options)
                except BackendUnavailableError as exc:  # importable but unusable (e.g. driver too old)
                    reason = str(exc)
                else:
                    logger.info("%s backend: auto chose %s on %s%s", self.kind, name, device,
                                f" (skipped {'; '.join(skipped)})" if skipped else "")
                    return backend
            skipped.append(f"{name}: {reason}")
        raise BackendUnavailableError(f"no {self.kind} backend can run on {device}: "
                                      f"{'; '.join(skipped) or 'unsupported device type'}")


# On CUDA: DALI (hardware JPEG decode, batched GPU resize), then torchvision's
# nvJPEG, then Pillow. On the CPU only Pillow: it is the exact reference, and
# DALI's CPU mode is not faster enough to give that up (it can still be named).
_IMAGES = _Registry("media", {"cuda": ("dali", "nvjpeg", "pillow"), "cpu": ("pillow",)})
# On CUDA: DALI (NVDEC), then PyAV; on the CPU PyAV, the exact reference.
_VIDEOS = _Registry("video", {"cuda": ("dali", "pyav"), "cpu": ("pyav",)})


def register_backend(name: str, factory: Factory, available_fn: AvailableFn) -> None:
    """Add an image backend. `factory(device, **options)` builds it;
    `available_fn(device)` returns None when it can run there, else why not."""
    _IMAGES.register(name, factory, available_fn)


def register_video_backend(name: str, factory: Factory, available_fn: AvailableFn) -> None:
    """Add a video backend, as `register_backend` does an image one."""
    _VIDEOS.register(name, factory, available_fn)


def backend_names() -> tuple[str, ...]:
    _register_builtins()
    return tuple(_IMAGES.entries)


def video_backend_names() -> tuple[str, ...]:
    _register_builtins()
    return tuple(_VIDEOS.entries)


def unavailable_reason(name: str, device: torch.device | str) -> str | None:
    """None when image backend `name` can run on `device`, else what is missing."""
    return _IMAGES.unavailable_reason(name, device)


def available_backends(device: torch.device | str) -> list[str]:
    """Registered image backends that can run on `device`, in registration order."""
    return [name for name in backend_names() if unavailable_reason(name, device) is None]


def create_backend(name: str, device: torch.device | str, **options: Any) -> MediaBackend:
    """Build image backend `name` ("auto", "pillow", "dali", "nvjpeg", or any
    registered one) for `device`. Raises BackendUnavailableError if a named
    backend cannot run there. `options` go to the factory; the built-in ones
    all take num_threads (CPU decode threads)."""
    return _IMAGES.create(name, device, options)


def create_video_backend(name: str, device: torch.device | str, **options: Any) -> VideoBackend:
    """Build video backend `name` ("auto", "pyav", "dali", or any registered
    one) for `device`, as `create_backend` does an image one."""
    return _VIDEOS.create(name, device, options)


def _register_builtins() -> None:
    # Imported here, not at module top, so that the backend modules (which import
    # base) never form a cycle with the registry; each imports its heavy
    # dependency (DALI, torchvision) only when built or probed.
    if "pillow" in _IMAGES.entries:
        return
    from pipeline.media import dali_backend, dali_video, nvjpeg_backend, pillow_backend, video_backend

    _IMAGES.register("pillow", pillow_backend.PillowBackend, pillow_backend.unavailable_reason)
    _IMAGES.register("dali", dali_backend.DaliBackend, dali_backend.unavailable_reason)
    _IMAGES.register("nvjpeg", nvjpeg_backend.NvjpegBackend, nvjpeg_backend.unavailable_reason)
    _VIDEOS.register("pyav", video_backend.PyAVVideoBackend, video_backend.pyav_unavailable_reason)
    _VIDEOS.register("dali", dali_video.DaliVideoBackend, dali_video.unavailable_reason)
