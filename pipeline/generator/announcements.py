"""An encoder announced itself (on start, restart, or our hello): open its
arena here, and read what waited for it."""

from __future__ import annotations

import logging

from pipeline import protocol
from pipeline.generator.intake import on_embedding, settle_copies_from

log = logging.getLogger("epd.generator")


def on_announce(service, message: protocol.EncoderAnnounce) -> None:
    """`service` is the GeneratorService (not imported: it imports this)."""
    service.encoder_addresses[message.encoder_id] = message.address
    previous = service.encoder_arenas.get(message.encoder_id)
    if previous is not None and previous != message.arena.arena_id:
        settle_copies_from(service, previous)
        service.reader.close_arena(previous)  # the encoder restarted: its old arena is gone
    try:
        service.reader.open(message.arena)
    except Exception as exc:   # a bad announcement must not stop this generator
        log.warning("cannot open the arena that encoder %s announced: %s", message.encoder_id, exc)
        reason = f"image embedding unreadable: encoder {message.encoder_id}'s arena cannot be opened here: {exc}"
        for ready in service.waiting_for_arena.take_from(message.encoder_id):
            # Asked again, the same encoder would hand over the same arena: the requests fail.
            service.release(ready)
            service.fail_key(ready.content_hash, reason)
        return
    service.encoder_arenas[message.encoder_id] = message.arena.arena_id
    width = service.engine.model.spec.embedding_width
    if message.widths.get("image", width) != width:
        # Each of its embeddings will fail its request (Engine.add_embedding).
        log.error("encoder %s makes image embeddings %d wide; this generator's model takes %d",
                  message.encoder_id, message.widths["image"], width)
    for ready, since in service.waiting_for_arena.take_all():
        on_embedding(service, ready, since)
