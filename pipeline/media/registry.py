"""Media backends by name, and the choice "auto" makes.

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

logger = logging.getLogger(__name__)

Factory = Callable[..., MediaBackend]
AvailableFn = Callable[[torch.device], "str | None"]

# The order "auto" tries. On CUDA: DALI (hardware JPEG decode, batched GPU
# resize), then torchvision's nvJPEG, then Pillow. On the CPU only Pillow:
# it is the exact reference, and DALI's CPU mode is not faster enough to give
# that up (it can still be named explicitly).
_AUTO_ORDER = {"cuda": ("dali", "nvjpeg", "pillow"), "cpu": ("pillow",)}


@dataclass(frozen=True)
class _Entry:
    factory: Factory
    available_fn: AvailableFn


_BACKENDS: dict[str, _Entry] = {}


def register_backend(name: str, factory: Factory, available_fn: AvailableFn) -> None:
    """Add a backend. `factory(device, **options)` builds it; `available_fn(device)`
    returns None when it can run there, else why not. Names are unique."""
    if not name or name == "auto":
        raise ValueError(f"invalid backend name {name!r}")
    if name in _BACKENDS:
        raise ValueError(f"media backend {name!r} is already registered")
    _BACKENDS[name] = _Entry(factory, available_fn)


def backend_names() -> tuple[str, ...]:
    _register_builtins()
    return tuple(_BACKENDS)


def unavailable_reason(name: str, device: torch.device | str) -> str | None:
    """None when backend `name` can run on `device`, else what is missing."""
    _register_builtins()
    if name not in _BACKENDS:
        raise ValueError(f"unknown media backend {name!r}; known: auto, {', '.join(_BACKENDS)}")
    return _BACKENDS[name].available_fn(torch.device(device))


def available_backends(device: torch.device | str) -> list[str]:
    """Registered backends that can run on `device`, in registration order."""
    return [name for name in backend_names() if unavailable_reason(name, device) is None]


def create_backend(name: str, device: torch.device | str, **options: Any) -> MediaBackend:
    """Build backend `name` ("auto", "pillow", "dali", "nvjpeg", or any registered
    one) for `device`. Raises BackendUnavailableError if a named backend cannot
    run there. `options` go to the factory; the built-in ones all take
    num_threads (CPU decode threads)."""
    device = torch.device(device)
    if name == "auto":
        return _create_auto(device, options)
    reason = unavailable_reason(name, device)
    if reason is not None:
        raise BackendUnavailableError(f"media backend {name!r} is not available on {device}: {reason}")
    backend = _BACKENDS[name].factory(device, **options)
    logger.info("media backend: %s on %s", backend.name, device)
    return backend


def _create_auto(device: torch.device, options: dict[str, Any]) -> MediaBackend:
    """The first backend in _AUTO_ORDER that is available and builds; the log
    line names it and why each one before it was skipped."""
    skipped = []
    for name in _AUTO_ORDER.get(device.type, ()):
        reason = unavailable_reason(name, device)
        if reason is None:
            try:
                backend = _BACKENDS[name].factory(device, **options)
            except BackendUnavailableError as exc:  # importable but unusable (e.g. driver too old)
                reason = str(exc)
            else:
                logger.info("media backend: auto chose %s on %s%s", name, device,
                            f" (skipped {'; '.join(skipped)})" if skipped else "")
                return backend
        skipped.append(f"{name}: {reason}")
    raise BackendUnavailableError(f"no media backend can run on {device}: "
                                  f"{'; '.join(skipped) or 'unsupported device type'}")


def _register_builtins() -> None:
    # Imported here, not at module top, so that the backend modules (which import
    # base) never form a cycle with the registry; each imports its heavy
    # dependency (DALI, torchvision) only when built or probed.
    if "pillow" in _BACKENDS:
        return
    from pipeline.media import dali_backend, nvjpeg_backend, pillow_backend

    register_backend("pillow", pillow_backend.PillowBackend, pillow_backend.unavailable_reason)
    register_backend("dali", dali_backend.DaliBackend, dali_backend.unavailable_reason)
    register_backend("nvjpeg", nvjpeg_backend.NvjpegBackend, nvjpeg_backend.unavailable_reason)
