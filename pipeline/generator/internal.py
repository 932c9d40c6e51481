"""What the generator's receiver thread hands its engine thread besides
protocol messages, and the receiver-side work that makes them."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from pipeline import protocol
from pipeline.generator.media_budget import HeldBytes

log = logging.getLogger("epd.generator")


@dataclass(frozen=True)
class PreparedRequest:
    """Aggregated mode: a generate request whose images the receiver thread
    already decoded, so decoding never stalls the engine thread."""

    request: protocol.GenerateRequest
    inputs: list | None
    error: str = ""
    backend_failed: bool = False   # the decoder failed, not the media: the engine thread asks if the GPU is gone


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
    except Exception as exc:   # a backend failure: on a worker, it would be lost with its request
        log.exception("decoding the media of %s failed", request.request_id)
        return PreparedRequest(request, None, f"media decoding failed: {exc}", backend_failed=True)


@dataclass
class DecodeSkips:
    """Aggregated mode: the requests whose media wait for a decode worker,
    and those of them aborted meanwhile, whose decode is skipped (a clip takes
    a worker hundreds of ms; a backlog left by clients that hung up must not
    delay the requests behind it)."""

    queued: set[str] = field(default_factory=set)
    aborted: set[str] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, request_id: str) -> None:
        with self.lock:
            self.queued.add(request_id)

    def abort(self, request_ids) -> None:
        """Call after the abort is on the engine thread's queue: a skipped
        request then meets its abort there first."""
        with self.lock:
            self.aborted.update(r for r in request_ids if r in self.queued)

    def take(self, request_id: str) -> bool:
        """The worker's turn: True if the request was aborted (skip it)."""
        with self.lock:
            self.queued.discard(request_id)
            if request_id in self.aborted:
                self.aborted.discard(request_id)
                return True
            return False


def prepare_unless_aborted(request: protocol.GenerateRequest, decode_images: Callable, skips: DecodeSkips,
                           budget: HeldBytes, stop: threading.Event) -> PreparedRequest:
    """A decode worker's job: skipped if aborted while queued; once decoded,
    handed on only when the media budget has room for it."""
    if skips.take(request.request_id):
        return PreparedRequest(request, None, "aborted before its media were decoded")
    prepared = prepare(request, decode_images)
    if prepared.inputs is not None and not budget.hold([pixels for pixels, _ in prepared.inputs], stop):
        return PreparedRequest(request, None, "the generator is stopping")
    return prepared
