"""The embedding arena on the CPU: blocks, index rules, shared memory."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import msgspec
import pytest
import torch

from pipeline.arena.blocks import BlockAllocator
from pipeline.arena.index import ArenaFull, EmbeddingIndex, State
from pipeline.arena.reader import ArenaReader, StaleHandleError
from pipeline.arena.shm import ShmSegment, our_segments, remove_stale_segments, segment_name
from pipeline.arena.store import ArenaStore


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# ------------------------------------------------------------------ blocks

def test_blocks_first_fit_and_coalescing():
    blocks = BlockAllocator(10)
    a, b, c = blocks.allocate(3), blocks.allocate(3), blocks.allocate(3)
    assert (a, b, c) == (0, 3, 6)
    assert blocks.allocate(2) is None and blocks.largest_free_run() == 1
    blocks.free(b, 3)
    assert blocks.allocate(2) == 3          # first fit into the hole
    blocks.free(3, 2)
    blocks.free(a, 3)
    blocks.free(c, 3)
    assert blocks.free_blocks == 10 and blocks.largest_free_run() == 10  # fully coalesced
    with pytest.raises(ValueError):
        blocks.free(0, 1)                   # double free is caught


# ------------------------------------------------------------------- index

def ready(index, key, nbytes=100):
    entry = index.reserve(key, nbytes, (nbytes // 4,), "float32")
    index.mark_ready(key)
    return entry


def test_lru_eviction_skips_leased_and_encoding_entries():
    index = EmbeddingIndex(num_blocks=4, block_bytes=100)
    ready(index, "a"); ready(index, "b")
    index.reserve("c", 100, (25,), "float32")          # encoding: not evictable
    lease = index.lease("a", "gen-0", "req-1")          # leased: not evictable
    ready(index, "d")                                   # arena now full; unused: b, d
    index.get("b")                                      # a hit makes b recent: d, b
    index.release(lease.lease_id)                       # a becomes unused, most recent: d, b, a
    ready(index, "e")                                   # evicts the least recently used: d
    assert set(index.entries) == {"a", "b", "c", "e"}
    assert index.evictions == 1
    ready(index, "f")                                   # then b (c is still encoding)
    assert set(index.entries) == {"a", "c", "e", "f"}


def test_arena_full_when_everything_is_in_use():
    index = EmbeddingIndex(num_blocks=2, block_bytes=100)
    ready(index, "a")
    index.lease("a", "gen-0", "r")
    index.reserve("b", 100, (25,), "float32")
    with pytest.raises(ArenaFull, match="every entry in use"):
        index.reserve("c", 100, (25,), "float32")
    with pytest.raises(ArenaFull, match="exceeds the whole arena"):
        index.reserve("huge", 1000, (250,), "float32")
    assert set(index.entries) == {"a", "b"}            # a failed reserve changed nothing


def test_generations_are_new_for_every_allocation():
    index = EmbeddingIndex(num_blocks=1, block_bytes=100)
    first = ready(index, "a")
    second = ready(index, "b")                          # evicts a, reuses its block
    assert second.start_block == first.start_block
    assert second.generation > first.generation


def test_abort_frees_an_encoding_entry():
    index = EmbeddingIndex(num_blocks=1, block_bytes=100)
    index.reserve("a", 100, (25,), "float32")
    index.abort("a")
    assert index.entries == {} and index.blocks.free_blocks == 1


def test_leases_expire_when_owner_stops_heartbeating():
    clock = FakeClock()
    index = EmbeddingIndex(num_blocks=4, block_bytes=100, lease_timeout=5.0, clock=clock)
    ready(index, "a"); ready(index, "b")
    l1 = index.lease("a", "gen-0", "r1")
    index.lease("b", "gen-0", "r2")
    index.lease("b", "gen-1", "r3")
    clock.now = 4.0
    index.heartbeat("gen-1")
    clock.now = 6.0
    dropped = index.expire()
    assert sorted(l.request_id for l in dropped) == ["r1", "r2"]
    assert index.lease_count == 1 and not index.release(l1.lease_id)
    assert "a" in index.unused and "b" not in index.unused
    clock.now = 20.0
    index.expire()
    assert index.lease_count == 0 and set(index.unused) == {"a", "b"}


def test_an_owner_restarted_in_place_loses_only_its_predecessors_leases():
    """It keeps heartbeating under the same name, so expiry never comes:
    leases taken before the new incarnation started are dropped."""
    index = EmbeddingIndex(num_blocks=4, block_bytes=100)
    ready(index, "a"); ready(index, "b")
    old = index.lease("a", "gen-0", "r1")
    other = index.lease("a", "gen-1", "r2")
    started = time.time()
    time.sleep(0.01)
    new = index.lease("b", "gen-0", "r3")
    dropped = index.drop_owner("gen-0", taken_before=started)
    assert [l.lease_id for l in dropped] == [old.lease_id]
    assert set(index.leases) == {other.lease_id, new.lease_id}
    index.heartbeat("gen-0")            # still a known owner: its leases still expire if it goes silent
    assert "gen-0" in index.owner_seen


def test_lease_requires_ready_entry():
    index = EmbeddingIndex(num_blocks=1, block_bytes=100)
    index.reserve("a", 100, (25,), "float32")
    with pytest.raises(ValueError, match="not ready"):
        index.lease("a", "g", "r")
    assert index.get("a").state is State.ENCODING


# -------------------------------------------------------- store and reader

@pytest.fixture
def store():
    store = ArenaStore(capacity=64 * 1024, block_bytes=1024, device=torch.device("cpu"), instance="test-arena")
    yield store
    store.close()


def test_store_and_reader_share_memory_and_detect_reuse(store):
    reader = ArenaReader()
    reader.open(store.info)
    emb = torch.randn(10, 64)
    entry = store.reserve("h1", tuple(emb.shape), emb.dtype)
    store.write(entry, emb)
    store.index.mark_ready("h1")
    handle = store.handle(entry)
    assert torch.equal(reader.read(handle), emb)
    # The entry is evicted and its blocks reused: the old handle is stale.
    store.index.evict("h1")
    other = store.reserve("h2", (10, 64), torch.float32)
    store.write(other, torch.zeros(10, 64))
    with pytest.raises(StaleHandleError):
        reader.read(handle)
    reader.close_arena(store.info.arena_id)
    assert not reader.is_open(store.info.arena_id)
    reader.close()


def test_segments_are_removed_on_close_and_after_a_crash():
    before = set(our_segments())
    store = ArenaStore(capacity=8192, block_bytes=1024, device=torch.device("cpu"), instance="test-close")
    names = {store.info.generations_name, store.info.data_name}
    assert names <= set(our_segments())
    store.close()
    assert not [n for n in set(our_segments()) - before if n.startswith("epd-test-close-")]
    # A process that dies without closing leaves its segment; the instance's
    # next incarnation removes it.
    code = ("import os; from pipeline.arena.shm import ShmSegment, segment_name;"
            "ShmSegment.create(segment_name('test-crash', 'data'), 4096); os._exit(9)")
    subprocess.run([sys.executable, "-c", code], check=False, cwd=os.getcwd())
    leftovers = [n for n in our_segments() if n.startswith("epd-test-crash-")]
    assert len(leftovers) == 1
    assert remove_stale_segments("test-crash") == leftovers
    assert not [n for n in our_segments() if n.startswith("epd-test-crash-")]


def test_segment_names_parse_back():
    name = segment_name("encoder-0", "data", pid=123)
    assert name == "epd-encoder-0-123-data"
    seg = ShmSegment.create(segment_name("test-parse", "gen"), 4096)
    assert ShmSegment.open(seg.name).nbytes == 4096
    seg.close()


def test_reader_opens_only_segments_named_like_ours(store):
    """An announcement is input from another process: no path in it reaches
    os.open."""
    reader = ArenaReader()
    for field in ("generations_name", "data_name"):
        bad = msgspec.structs.replace(store.info, **{field: "../../etc/passwd"})
        with pytest.raises(ValueError, match="not a shared-memory segment name"):
            reader.open(bad)
    assert not reader.is_open(store.info.arena_id)
    reader.open(store.info)
    assert reader.is_open(store.info.arena_id)
    reader.close()


def test_handles_whose_shape_and_size_disagree_or_leave_the_arena_are_refused(store):
    reader = ArenaReader()
    reader.open(store.info)
    entry = store.reserve("h", (4, 8), torch.float32)
    store.write(entry, torch.ones(4, 8))
    handle = store.handle(entry)
    assert torch.equal(reader.read(handle), torch.ones(4, 8))
    for bad, message in ((msgspec.structs.replace(handle, shape=(100000, 8)), "does not make 128 bytes"),
                         (msgspec.structs.replace(handle, shape=(-4, -8)), "does not make"),
                         (msgspec.structs.replace(handle, offset=store.info.capacity - 64), "outside arena"),
                         (msgspec.structs.replace(handle, offset=-1024), "outside arena")):
        with pytest.raises(ValueError, match=message):
            reader.read_async(bad)
    reader.close()
