"""What the generator's receiver thread hands its engine thread besides
protocol messages, and the receiver-side work that makes them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pipeline import protocol


@dataclass(frozen=True)
class PreparedRequest:
    """Aggregated mode: a generate request whose images the receiver thread
    already decoded, so decoding never stalls the engine thread."""

    request: protocol.GenerateRequest
    inputs: list | None
    error: str = ""


@dataclass(frozen=True)
class AskerRestarted:
    """The process at `address` (a proxy) is a new incarnation: the requests
    its predecessor sent have no client left."""

    address: str


def prepare(request: protocol.GenerateRequest, decode_images: Callable) -> PreparedRequest:
    """Decode an aggregated-mode request's images and videos (on a
    receiver-side worker): `decode_images(request)` -> [(pixels, grid)] per item."""
    try:
        return PreparedRequest(request, decode_images(request))
    except ValueError as exc:
        return PreparedRequest(request, None, str(exc))
