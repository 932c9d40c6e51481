"""Image decoding and preprocessing backends: encoded bytes -> vision-tower input.

Pick one with `create_backend("auto" | "pillow" | "dali" | "nvjpeg", device)`;
every backend implements `MediaBackend.decode`.
"""

from pipeline.media.base import BackendUnavailableError, DecodedImage, MediaBackend, Tolerance
from pipeline.media.registry import available_backends, create_backend, register_backend

__all__ = [
    "BackendUnavailableError", "DecodedImage", "MediaBackend", "Tolerance",
    "available_backends", "create_backend", "register_backend",
]
