"""Embeddings a request still needs that its generator no longer has, or
cannot read: evicted from its encoder cache (a preemption, or room made for
an image needed sooner), announced by an encoder that died or restarted
before the handle was read, or handed over with blocks since reused.

The generator first asks the encoder that delivered the embedding
(FetchEmbedding): the bytes are likely still in its arena, and nothing
travels twice. If that encoder says the entry is gone, or says nothing
within FETCH_WAIT_S (it died), or no encoder is known, the generator asks
the proxy of each request that needs it (EmbeddingWanted); the proxy sends
the encode job again, from the media it keeps until the request ends, to a
live encoder, and the embedding comes as the first one did. A key asked for
at the proxy that has not come within `want_s`, or lost MAX_WANTS times
running, fails its requests with a retryable error (503), never silently
waits forever.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from pipeline import protocol

log = logging.getLogger("epd.generator")

FETCH_WAIT_S = 5.0   # an encoder answers from its arena in milliseconds; silence this long: it is gone
MAX_WANTS = 3        # a key lost this often without one good read fails its requests (a broken producer)
FETCH_JOB = "refetch-"   # the job id prefix of FetchEmbedding, which names one of the key's requests


@dataclass
class _Ask:
    at_proxy: bool    # False: the delivering encoder was asked
    deadline: float   # inf once answered: the handle waits here (parked) to be read
    wants: int        # times asked for at the proxy since the last good read


class Refetches:
    """The keys asked for again and not yet delivered (the ledger only)."""

    def __init__(self, want_s: float) -> None:
        self.want_s = want_s
        self._asks: dict[str, _Ask] = {}

    def start_fetch(self, key: str, now: float) -> bool:
        """Record an ask at the key's encoder; False if it is asked for already."""
        if key in self._asks:
            return False
        self._asks[key] = _Ask(False, now + FETCH_WAIT_S, 0)
        return True

    def start_want(self, key: str, now: float) -> bool:
        """Record an ask at the proxy; False when the key was lost MAX_WANTS
        times without a good read (then it is forgotten: give up)."""
        ask = self._asks.get(key)
        wants = ask.wants if ask is not None else 0
        if wants >= MAX_WANTS:
            del self._asks[key]
            return False
        self._asks[key] = _Ask(True, now + self.want_s, wants + 1)
        return True

    def answered(self, key: str) -> None:
        """A handle for the key came; it may wait here for room before it is read."""
        if key in self._asks:
            self._asks[key].deadline = math.inf

    def arrived(self, key: str) -> None:
        """The key was read (or encoded here): nothing is owed any more."""
        self._asks.pop(key, None)

    def overdue(self, now: float, needed: Callable[[str], bool]) -> tuple[list[str], list[str]]:
        """(keys whose encoder did not answer in time: ask the proxy, keys the
        proxy did not deliver in time: give up); keys no request needs any
        more are forgotten."""
        unanswered, late = [], []
        for key, ask in list(self._asks.items()):
            if not needed(key):
                del self._asks[key]
            elif now > ask.deadline:
                (late if ask.at_proxy else unanswered).append(key)
        for key in late:
            del self._asks[key]
        return unanswered, late

    def __len__(self) -> int:
        return len(self._asks)

    def __contains__(self, key: str) -> bool:
        return key in self._asks


# The steps below take the GeneratorService (not imported: it imports this).

def refetch_evicted(service) -> None:
    """After a step: ask again for the keys the engine evicted (or lost to a
    preemption) that some request still needs."""
    now = time.monotonic()
    for key in service.engine.take_refetches():
        users = service.engine.embedding_users(key)
        if not users:
            continue
        address = service.key_sources.address_of(key)
        if not address:
            want_again(service, key, "evicted here, and its encoder is unknown")
            continue
        if not service.refetches.start_fetch(key, now):
            continue
        request_id = next(iter(users))
        length = service.engine.request_image_tokens(request_id, key)
        service.send(address, protocol.FetchEmbedding(f"{FETCH_JOB}{key}", request_id, key, service.address,
                                                      length))
        service.counters["refetches.encoder"] += 1


def want_again(service, key: str, reason: str, silent_encoder: str = "") -> None:
    """Ask the proxies of the requests that need `key` to have it encoded
    again (not by `silent_encoder`, which let it down); or, lost too often,
    fail those requests."""
    requests = [rid for rid in service.engine.embedding_users(key) if rid in service.requests]
    if not requests:
        service.refetches.arrived(key)   # nobody here waits for it
        return
    if not service.refetches.start_want(key, time.monotonic()):
        give_up(service, key, f"lost {MAX_WANTS} times ({reason})")
        return
    log.warning("image embedding %s lost (%s): asking the proxy for it again", key[:16], reason)
    for request_id in requests:
        service.send(service.requests.get(request_id).reply_to,
                     protocol.EmbeddingWanted(request_id, (key,), service.address, reason, silent_encoder))
    service.counters["refetches.proxy"] += 1


def lost_handles(service, handles: list[protocol.EmbeddingReady], reason: str) -> None:
    """Announced handles this generator will not read (their arena never
    opened here: the encoder died or restarted): leases back, keys asked for again."""
    for ready in handles:
        service.release(ready)
        want_again(service, ready.content_hash, reason, service.encoder_addresses.get(ready.encoder_id, ""))


def handed_back(service, ready: protocol.EmbeddingReady) -> None:
    """A handle given back unread because its request is gone. If it was
    the answer to a FetchEmbedding, the key's other users still wait for
    one (a job asked for again at the proxy brings each request its own)."""
    service.release(ready)
    if ready.job_id.startswith(FETCH_JOB) and ready.content_hash in service.refetches:
        want_again(service, ready.content_hash, "the request it was asked for ended")


def give_up(service, key: str, reason: str) -> None:
    service.refetches.arrived(key)
    service.counters["refetches.failed"] += 1
    service.fail_key(key, f"image embedding lost and not delivered again: {reason}; retry the request", 503)


def expire_refetches(service, now: float) -> None:
    unanswered, late = service.refetches.overdue(now, service.engine.embedding_needed)
    for key in unanswered:
        want_again(service, key, f"its encoder did not answer within {FETCH_WAIT_S:g} s",
                   service.key_sources.address_of(key))
    for key in late:
        give_up(service, key, f"not delivered within {service.refetches.want_s:g} s")
