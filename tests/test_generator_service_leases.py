"""The generator service's leases at its edges: what it gives back when it
closes, and an encoder restarting while a copy from its old arena is still
pending (tests/test_generator_service.py's harness)."""

from __future__ import annotations

import torch

from pipeline import protocol
from pipeline.arena.store import ArenaStore
from test_generator_service import ENCODER, WIDTH, FakeEngine, Harness, generate, released, store  # noqa: F401


def test_closing_gives_every_parked_lease_back(store):
    harness = Harness(store, FakeEngine(room_tokens=4))
    harness.turn(harness.announce())
    harness.turn(generate("r1", ("a", "b")))
    harness.turn(harness.ready("r1", "a"))
    parked = harness.ready("r1", "b")
    assert released(harness.turn(parked)) == []
    harness.sent.clear()
    harness.service.close()
    assert released(harness.sent) == [parked.lease_id]



def test_closing_gives_back_the_handles_waiting_for_an_arena(store):
    other = ArenaStore(1 << 20, 4096, torch.device("cpu"), "test-gensvc-other")
    harness = Harness(store, FakeEngine())
    try:
        harness.turn(harness.announce())        # enc-0's address is known; this arena is not open here
        entry = other.reserve("k", (4, WIDTH), torch.float32)
        other.write(entry, torch.ones(4, WIDTH))
        harness.turn(generate("r1", ("k",)))
        harness.turn(protocol.EmbeddingReady("r1/0", "r1", "k", other.handle(entry), "lease-other", "enc-0"))
        assert len(harness.service.waiting_for_arena) == 1
        harness.sent.clear()
        harness.service.close()
        assert released(harness.sent) == ["lease-other"]
    finally:
        other.close()



def test_an_encoder_that_restarts_while_a_copy_from_its_old_arena_is_pending(store):
    """Its new announcement is read in the turn the copy was queued in: the
    copy is settled (checked, its lease given back) before the old arena is
    unmapped. (Checked after, it raised KeyError and stopped the generator.)"""
    new_arena = ArenaStore(1 << 20, 4096, torch.device("cpu"), "test-gensvc-new")
    harness = Harness(store, FakeEngine())
    try:
        harness.turn(harness.announce())
        harness.turn(generate("r1", ("k",)))
        ready = harness.ready("r1", "k")
        restarted = protocol.EncoderAnnounce("enc-0", ENCODER, "tiny", new_arena.info, {"image": WIDTH})
        sent = harness.turn(ready, restarted)
        assert released(sent) == [ready.lease_id] and "k" in harness.engine.embeddings
        reader = harness.service.reader
        assert reader.is_open(new_arena.info.arena_id) and not reader.is_open(store.info.arena_id)
    finally:
        harness.service.close()
        new_arena.close()
