"""Requests that ended before their images were encoded (a client gone, a
failure): the proxy tells the encoders too, and what they have not begun
for them is dropped, so a disconnect storm sheds the encoders' load."""

from __future__ import annotations

from collections import deque


def drop_aborted(service, request_ids: set[str]) -> None:
    """`service` is the EncoderService (not imported: it imports this). The
    requests' jobs leave their media's waiter lists; media that no other job
    waits for and whose work has not begun is not decoded or encoded. Media
    being decoded or in a forward stays in flight, for a later job to join:
    dropped there, a second copy of its work could start and find its arena
    entry taken."""
    emptied = service.flight.leave(lambda job: job.request_id in request_ids)
    waiting = {key for key, _ in service.to_decode} | {d.content_hash for d in service.decoded}
    dropped = {key for key in emptied if key in waiting}
    if not dropped:
        return
    for key in dropped:
        service.flight.finish(key)
    service.to_decode = deque(item for item in service.to_decode if item[0] not in dropped)
    service.decoded = deque(d for d in service.decoded if d.content_hash not in dropped)
    service.counters["dropped_media"] += len(dropped)
    service._decode_wake.set()
