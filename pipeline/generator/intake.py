"""The generator's embedding intake: announced handles read out of the
encoders' arenas (at once, or once there is room: parking.py), their leases
released when the copy is done, and what cannot be read asked for again
(refetch.py). Also the one way an embedding enters the engine, read here
or encoded by the generator itself (local_encode.py)."""

from __future__ import annotations

import torch

from pipeline import protocol
from pipeline.arena.reader import StaleHandleError
from pipeline.generator.refetch import handed_back, want_again

# The steps below take the GeneratorService (not imported: it imports this).


def on_embedding(service, ready: protocol.EmbeddingReady, parked_since: float | None = None,
                 unparked: bool = False) -> None:
    if not service.reader.is_open(ready.handle.arena_id):
        # An encoder we have not heard from: ask it, keep the handle (leased) meanwhile.
        if service.waiting_for_arena.park(ready, parked_since):
            service.hello_all()
        return
    if service.requests.gone(ready.request_id):
        handed_back(service, ready)    # its request is over: nothing here will read it
        return
    service.refetches.answered(ready.content_hash)
    if not unparked and (service.parking.parked or not service.engine.has_room_for(ready.handle.shape[0])):
        service.parking.park(ready)   # behind those parked before it
        service.counters["parked"] += 1
        service.requests.delivered(ready.content_hash)   # it came: no timeout while it waits here
        return
    encoder = service.encoder_addresses.get(ready.encoder_id, "")
    try:
        # Queued on this thread's stream: the forward that uses it runs after
        # it on the same stream, so nothing here waits for the copy.
        pending = service.reader.read_async(ready.handle, device=service.device)
    except (StaleHandleError, ValueError) as exc:   # reused blocks, or a handle outside the arena
        service.send(encoder, protocol.ReleaseLease((ready.lease_id,), service.address))
        want_again(service, ready.content_hash, f"unreadable: {exc}")
        return
    service.copies.append((pending, ready, encoder))
    service.counters["embeddings"] += 1
    service.key_sources.remember(ready.content_hash, encoder)
    take_embedding(service, ready.request_id, ready.content_hash, pending.tensor)


def take_embedding(service, request_id: str, key: str, embedding: torch.Tensor) -> None:
    """An embedding is here (copied from an arena, or encoded by this generator)."""
    service.refetches.arrived(key)
    try:
        service.engine.add_embedding(key, embedding)
    except ValueError as exc:
        service.fail_key(key, str(exc), 400)
        return
    service.requests.delivered(key)
    if request_id not in service.requests:
        service.early.hold(request_id, key, embedding)


def unpark(service) -> None:
    for ready in service.parking.drop_gone(lambda r: service.requests.gone(r.request_id)):
        handed_back(service, ready)
    while (ready := service.parking.next_fitting(service.engine)) is not None:
        on_embedding(service, ready, unparked=True)


def finish_copies(service) -> None:
    """Release the leases of copies that have completed (checked against
    the arena's generations first)."""
    still = []
    for pending, ready, encoder in service.copies:
        if not pending.done():
            still.append((pending, ready, encoder))
            continue
        try:
            service.reader.verify(ready.handle)
        except StaleHandleError as exc:
            service.fail_key(ready.content_hash, f"image embedding overwritten while copied: {exc}")
        service.send(encoder, protocol.ReleaseLease((ready.lease_id,), service.address))
    service.copies = still


def settle_copies_from(service, arena_id: str) -> None:
    """Wait for the copies still reading `arena_id`, then check and release
    them: the arena is about to be unmapped (its encoder restarted with a
    new one), and a copy's check reads the arena's generations."""
    for pending, ready, _ in service.copies:
        if ready.handle.arena_id == arena_id:
            pending.wait()
    finish_copies(service)


def give_everything_back(service) -> None:
    """On stop: every lease back, the copies in flight waited for."""
    for ready in service.parking.drop_gone(lambda _: True):
        service.release(ready)
    for ready, _ in service.waiting_for_arena.take_all():
        service.release(ready)
    for pending, _, _ in service.copies:
        pending.wait()
    finish_copies(service)
