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
    """Decode an aggregated-mode request's images (on a receiver-side worker)."""
    try:
        return PreparedRequest(request, decode_images(request.media))
    except ValueError as exc:
        return PreparedRequest(request, None, str(exc))


class AskerIncarnations:
    """The incarnation each stats asker named last (receiver thread only)."""

    def __init__(self) -> None:
        self._known: dict[str, str] = {}

    def restarted(self, request: protocol.StatsRequest) -> bool:
        """True when the asker is a new incarnation at a known address. Its
        stats request comes before any request the new one sends (one
        socket, in order), so what is tracked for that address then is its
        predecessor's."""
        known = self._known.get(request.reply_to)
        self._known[request.reply_to] = request.incarnation
        return known is not None and known != request.incarnation
