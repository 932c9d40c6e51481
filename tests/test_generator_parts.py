"""The generator's small parts: embeddings held for the request they
overtook (EarlyArrivals), handles waiting for their arena (ArenaWaits), and
the stats askers' incarnations, recent request ids, and where each image key
came from."""

from __future__ import annotations

import time

import torch

from pipeline import protocol
from pipeline.generator.arena_waits import ArenaWaits
from pipeline.generator.early_arrivals import EarlyArrivals
from pipeline.generator.key_sources import KeySources
from pipeline.generator.recent_ids import RecentIds
from pipeline.incarnations import Incarnations


def test_a_request_claims_its_own_embeddings_once_and_unclaimed_ones_expire():
    early = EarlyArrivals(ttl_s=5.0)
    a, b = torch.ones(3, 4), torch.zeros(2, 4)
    early.hold("r1", "k1", a)
    early.hold("r1", "k2", b)
    early.hold("r2", "k1", a)
    assert len(early) == 2
    assert [(k, t.shape) for k, t in early.claim("r1")] == [("k1", (3, 4)), ("k2", (2, 4))]
    assert early.claim("r1") == [] and len(early) == 1
    now = time.monotonic()
    assert early.expire(now) == 0 and len(early) == 1      # not yet
    assert early.expire(now + 6.0) == 1 and len(early) == 0
    assert early.claim("r2") == []


def ready(request_id: str, arena: str, encoder: str) -> protocol.EmbeddingReady:
    handle = protocol.ArenaHandle(arena, 0, 16, (1, 4), "float32", 1)
    return protocol.EmbeddingReady(f"{request_id}/0", request_id, "k", handle, f"lease-{request_id}", encoder)


def test_handles_wait_for_their_arena_and_are_given_up_by_encoder_or_age():
    waits = ArenaWaits(wait_s=10.0)
    t0 = time.monotonic()
    assert waits.park(ready("a", "arena-1", "enc-1"), t0) is True      # first for arena-1: ask for it
    assert waits.park(ready("b", "arena-1", "enc-1"), t0) is False
    assert waits.park(ready("c", "arena-2", "enc-2"), t0 + 5) is True
    assert [r.request_id for r in waits.take_from("enc-1")] == ["a", "b"] and len(waits) == 1
    again = waits.take_all()
    assert [(r.request_id, since) for r, since in again] == [("c", t0 + 5)] and len(waits) == 0
    waits.park(*again[0])        # still unreadable: parks again, keeping its first time
    assert waits.take_overdue(t0 + 14) == [] and len(waits) == 1
    assert [r.request_id for r in waits.take_overdue(t0 + 16)] == ["c"] and len(waits) == 0


def test_a_peer_is_restarted_when_its_incarnation_changes():
    peers = Incarnations()
    assert not peers.restarted("ipc://proxy", "one")
    assert not peers.restarted("ipc://proxy", "one")
    assert not peers.restarted("ipc://other", "two")
    assert peers.restarted("ipc://proxy", "three")
    assert not peers.restarted("ipc://proxy", "three")


def test_recent_ids_expire_oldest_first_and_a_re_add_is_young_again():
    recent = RecentIds(ttl_s=10.0)
    recent.add("a")
    recent.add("b")
    recent.add("a")          # again: now the youngest
    assert "a" in recent and "b" in recent and len(recent) == 2
    now = time.monotonic()
    recent.expire(now + 5)
    assert len(recent) == 2
    assert recent.pop("b") and not recent.pop("b")
    recent.expire(now + 11)
    assert "a" not in recent and len(recent) == 0


def test_key_sources_forget_only_old_keys_nobody_needs():
    sources = KeySources(memory_s=60.0)
    sources.remember("needed", "ipc://enc0")
    sources.remember("idle", "ipc://enc1")
    assert sources.address_of("idle") == "ipc://enc1" and sources.address_of("never") == ""
    now = time.monotonic()
    sources.prune(now + 30, needed=lambda key: False)     # too soon to prune at all
    assert len(sources) == 2
    sources.prune(now + 61, needed=lambda key: key == "needed")
    assert sources.address_of("needed") == "ipc://enc0" and sources.address_of("idle") == ""
