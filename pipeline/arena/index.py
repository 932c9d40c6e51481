"""What is in an arena: content hash -> entry, leases, LRU, generations.

Plain CPU bookkeeping, no memory of its own (the store owns the buffer), so
every rule is testable alone:
- an entry being encoded, or leased, is never evicted or overwritten;
- unleased ready entries are evicted least-recently-used first, only when an
  allocation needs their space; if it still does not fit, ArenaFull;
- every allocation gets a new generation number, so a handle to reused blocks
  is detectably stale;
- a lease belongs to an owner (a generator); an owner that stops heartbeating
  for `lease_timeout` loses all its leases.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from pipeline.arena.blocks import BlockAllocator


class ArenaFull(Exception):
    """No room for an embedding: it is larger than the arena (ArenaFull
    itself), or every entry is in use (ArenaBusy)."""


class ArenaBusy(ArenaFull):
    """No room even after evicting every unused entry: back-pressure, retry later."""


class State(enum.Enum):
    ENCODING = "encoding"
    READY = "ready"


@dataclass(frozen=True)
class Lease:
    lease_id: str
    content_hash: str
    owner: str
    request_id: str
    taken_at: float = 0.0    # wall clock: comparable with a peer's start time on this host


@dataclass
class Entry:
    content_hash: str
    start_block: int
    num_blocks: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    generation: int
    state: State = State.ENCODING
    leases: dict[str, Lease] = field(default_factory=dict)


class EmbeddingIndex:
    def __init__(self, num_blocks: int, block_bytes: int, lease_timeout: float = 30.0,
                 clock: Callable[[], float] = time.monotonic, lease_prefix: str = "") -> None:
        self.blocks = BlockAllocator(num_blocks)
        self.block_bytes = block_bytes
        self.lease_timeout = lease_timeout
        self.clock = clock
        self.entries: dict[str, Entry] = {}
        self.unused: OrderedDict[str, Entry] = OrderedDict()   # evictable, oldest first
        self.leases: dict[str, Lease] = {}
        self.owner_seen: dict[str, float] = {}
        self._generations = itertools.count(1)
        self._lease_ids = itertools.count(1)
        self.lease_prefix = lease_prefix
        self.evictions = 0

    # ---------------------------------------------------------------- entries

    def get(self, content_hash: str) -> Entry | None:
        entry = self.entries.get(content_hash)
        if entry is not None and content_hash in self.unused:
            self.unused.move_to_end(content_hash)  # a hit counts as a use
        return entry

    def reserve(self, content_hash: str, nbytes: int, shape: tuple[int, ...], dtype: str) -> Entry:
        """Blocks for a new entry in state ENCODING, evicting LRU unused
        entries as needed. Raises ArenaFull (nothing changed but evictions)."""
        if content_hash in self.entries:
            raise KeyError(f"{content_hash} is already in the arena")
        count = max(1, -(-nbytes // self.block_bytes))
        if count > self.blocks.num_blocks:
            raise ArenaFull(f"an embedding of {nbytes} bytes exceeds the whole arena "
                            f"({self.blocks.num_blocks * self.block_bytes} bytes)")
        start = self.blocks.allocate(count)
        while start is None and self.unused:
            self._remove(next(iter(self.unused)))
            self.evictions += 1
            start = self.blocks.allocate(count)
        if start is None:
            raise ArenaBusy(f"arena full: {count} blocks needed, largest free run "
                            f"{self.blocks.largest_free_run()}, every entry in use")
        entry = Entry(content_hash, start, count, nbytes, tuple(shape), dtype, next(self._generations))
        self.entries[content_hash] = entry
        return entry

    def mark_ready(self, content_hash: str) -> Entry:
        entry = self.entries[content_hash]
        entry.state = State.READY
        if not entry.leases:
            self.unused[content_hash] = entry
        return entry

    def abort(self, content_hash: str) -> None:
        """Forget an entry whose encoding failed; its blocks are free again."""
        entry = self.entries.get(content_hash)
        if entry is not None and entry.state is State.ENCODING:
            self._remove(content_hash)

    def evict(self, content_hash: str) -> bool:
        """Drop an unused ready entry now; False if it is absent or in use."""
        if content_hash not in self.unused:
            return False
        self._remove(content_hash)
        return True

    def _remove(self, content_hash: str) -> None:
        entry = self.entries.pop(content_hash)
        self.unused.pop(content_hash, None)
        if entry.leases:
            raise RuntimeError(f"removing leased entry {content_hash}")
        self.blocks.free(entry.start_block, entry.num_blocks)

    # ----------------------------------------------------------------- leases

    def lease(self, content_hash: str, owner: str, request_id: str) -> Lease:
        entry = self.entries[content_hash]
        if entry.state is not State.READY:
            raise ValueError(f"{content_hash} is not ready")
        lease = Lease(f"{self.lease_prefix}{next(self._lease_ids)}", content_hash, owner, request_id, time.time())
        entry.leases[lease.lease_id] = lease
        self.leases[lease.lease_id] = lease
        self.unused.pop(content_hash, None)
        self.owner_seen[owner] = self.clock()
        return lease

    def release(self, lease_id: str) -> bool:
        """False if the lease is unknown (already released or expired)."""
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return False
        entry = self.entries[lease.content_hash]
        del entry.leases[lease_id]
        if not entry.leases and entry.state is State.READY:
            self.unused[entry.content_hash] = entry  # most recently used
        return True

    def heartbeat(self, owner: str) -> None:
        if owner in self.owner_seen:
            self.owner_seen[owner] = self.clock()

    def expire(self) -> list[Lease]:
        """Drop every lease of owners silent for longer than lease_timeout."""
        deadline = self.clock() - self.lease_timeout
        silent = [owner for owner, seen in self.owner_seen.items() if seen < deadline]
        return [lease for owner in silent for lease in self.drop_owner(owner)]

    def drop_owner(self, owner: str, taken_before: float | None = None) -> list[Lease]:
        """Release `owner`'s leases; with `taken_before` (wall clock) only
        those taken earlier: an owner restarted in place keeps what its new
        incarnation took, and loses what died with its predecessor."""
        dropped = [lease for lease in self.leases.values() if lease.owner == owner
                   and (taken_before is None or lease.taken_at < taken_before)]
        for lease in dropped:
            self.release(lease.lease_id)
        if taken_before is None:
            self.owner_seen.pop(owner, None)
        return dropped

    # ------------------------------------------------------------------ stats

    @property
    def bytes_used(self) -> int:
        return self.blocks.used * self.block_bytes

    @property
    def lease_count(self) -> int:
        return len(self.leases)
