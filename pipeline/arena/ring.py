"""A single-producer, single-consumer message ring in shared memory.

Same-host messages without a system call: the producer copies a message into
a slot and then bumps `written`; the consumer sees the new count on its next
look and reads the slot. Under the GPU box's sandbox every socket message
costs tens of microseconds of system calls (ZeroMQ: 28-48 us per message);
a look at the ring is a memory read.

Ordering rests on x86's total store order: the slot's bytes are stored
before the count, and the consumer loads the count before the slot, so a
count it sees covers bytes that are there. Python cannot issue fences on
weaker memory models, so `supported()` is False off x86 and callers keep
using sockets there.

Layout: four 64-byte lines (`written`; `read` and the consumer's liveness
stamp; `sleeping`; the geometry), then `slots` slots of `slot_bytes`, each a
little-endian u32 length and the message. `sleeping` is the consumer's "I
may block now, wake me by socket" flag; see `Consumer.may_sleep`.

A ring is a fast lane beside a socket, never the only way: `push` refuses
(and the caller sends by socket) when the ring is full, the message too big,
or the consumer has not read for `stale_s` (busy in a long step, or dead: a
dead consumer's ring is never written to for long).
"""

from __future__ import annotations

import logging
import platform
import socket
import threading
import time

from pipeline.arena.shm import ShmSegment, is_segment_name, remove_stale_segments, segment_name

log = logging.getLogger("epd.ring")

_HEADER = 256
# int64 indices into the header, one 64-byte line per writer's field group.
_WRITTEN, _READ, _ALIVE, _SLEEPING, _SLOTS, _SLOT_BYTES, _MAGIC = 0, 8, 9, 16, 24, 25, 26
MAGIC = 0x45504452494E4731    # "EPDRING1"
_LENGTH = 4
# Acquiring an uncontended lock is a locked instruction: on x86 a full fence,
# which orders our store to one line before our load of another.
_fence_lock = threading.Lock()


def supported() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


def _fence() -> None:
    with _fence_lock:
        pass


def host_id() -> str:
    """Names this host's boot, so a peer can tell whether our shared memory is
    its shared memory."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def ring_bytes(slots: int, slot_bytes: int) -> int:
    return _HEADER + slots * slot_bytes


class _Ring:
    def __init__(self, segment: ShmSegment) -> None:
        if segment.nbytes < _HEADER:
            segment.close()
            raise ValueError(f"{segment.name} is not a message ring")
        self.segment = segment
        self._view = memoryview(segment.mmap)
        # The header as int64 cells: a memoryview reads and writes one cell
        # in a third of numpy's time, and each is one aligned 8-byte access.
        self._header = self._view[:_HEADER].cast("q")
        self.slots, self.slot_bytes = self._header[_SLOTS], self._header[_SLOT_BYTES]
        if self._header[_MAGIC] != MAGIC or segment.nbytes < ring_bytes(self.slots, self.slot_bytes):
            self.close()
            raise ValueError(f"{segment.name} is not a message ring")

    @property
    def written(self) -> int:
        """Messages ever written into this ring."""
        return self._header[_WRITTEN]

    def _slot(self, seq: int) -> int:
        return _HEADER + (seq % self.slots) * self.slot_bytes

    def close(self) -> None:
        self._header.release()
        self._view.release()
        self.segment.close()


class Producer(_Ring):
    """The writing end. `push` never blocks: it returns False when the
    message should go by socket instead."""

    def __init__(self, segment: ShmSegment, stale_s: float) -> None:
        super().__init__(segment)
        self.stale_ns = int(stale_s * 1e9)

    @property
    def max_message(self) -> int:
        return self.slot_bytes - _LENGTH

    def push(self, message: bytes) -> bool:
        written = self._header[_WRITTEN]
        if (len(message) > self.max_message or written - self._header[_READ] >= self.slots
                or time.monotonic_ns() - self._header[_ALIVE] > self.stale_ns):
            return False
        start = self._slot(written)
        self._view[start:start + _LENGTH] = len(message).to_bytes(_LENGTH, "little")
        self._view[start + _LENGTH:start + _LENGTH + len(message)] = message
        self._header[_WRITTEN] = written + 1    # publishes the slot (x86 store order)
        return True

    def consumer_sleeping(self) -> bool:
        """After a push: True if the consumer may be blocked on its socket and
        needs a wake-up there. The fence orders our count store before this load."""
        _fence()
        return bool(self._header[_SLEEPING])


class Consumer(_Ring):
    """The reading end; it owns the read count and the liveness stamp."""

    def pending(self) -> int:
        return self._header[_WRITTEN] - self._header[_READ]

    def pop(self) -> list[bytes]:
        """Every message written since the last pop, oldest first. Popping is
        what keeps the ring alive for producers: call it at least every
        `stale_s` while messages are wanted here."""
        self._header[_ALIVE] = time.monotonic_ns()
        written, read = self._header[_WRITTEN], self._header[_READ]
        if not 0 <= written - read <= self.slots:
            # A producer never runs more than a ring ahead: this one is broken. Its
            # messages are lost (their requests time out); stale slots are never served.
            log.warning("ring %s: producer count %d against %d read; skipped", self.segment.name, written, read)
            self._header[_READ] = written
            return []
        out = []
        for seq in range(read, written):
            start = self._slot(seq)
            length = min(int.from_bytes(self._view[start:start + _LENGTH], "little"), self.slot_bytes - _LENGTH)
            out.append(bytes(self._view[start + _LENGTH:start + _LENGTH + length]))
        if written != read:
            self._header[_READ] = written     # frees the slots (after we copied them out)
        return out

    def may_sleep(self) -> bool:
        """Before blocking on the socket: raise the sleeping flag, then look
        once more. True: nothing is pending and a producer that pushes from now
        on will see the flag and wake us; False: read first (the flag is
        lowered again). The fence pairs with the producer's: either it sees the
        flag or we see its message."""
        self._header[_SLEEPING] = 1
        _fence()
        if self.pending():
            self._header[_SLEEPING] = 0
            return False
        return True

    def awake(self) -> None:
        self._header[_SLEEPING] = 0


def create(name: str, slots: int = 256, slot_bytes: int = 1024) -> Consumer:
    """The consumer creates (and on close unlinks) its inbound ring."""
    if slots < 1 or slot_bytes <= _LENGTH or slot_bytes % 8:
        raise ValueError(f"bad ring geometry: {slots} slots of {slot_bytes} bytes")
    segment = ShmSegment.create(name, ring_bytes(slots, slot_bytes))
    with memoryview(segment.mmap) as view, view[:_HEADER].cast("q") as header:
        header[_SLOTS], header[_SLOT_BYTES], header[_ALIVE] = slots, slot_bytes, time.monotonic_ns()
        header[_MAGIC] = MAGIC     # last: a producer that sees it sees the geometry
    return Consumer(segment)


def attach(name: str, stale_s: float = 0.5) -> Producer:
    """Open a consumer's ring by name (FileNotFoundError: not on this host,
    or gone; ValueError: not a ring, or not a name of ours)."""
    if not is_segment_name(name):
        raise ValueError(f"{name!r} is not a shared-memory segment name of ours")
    return Producer(ShmSegment.open(name), stale_s)


def create_inbound(instance: str, peers: list[str]) -> dict[str, Consumer]:
    """One ring per peer that may write to us (a ring has one producer),
    after removing what an earlier, crashed incarnation of `instance` left.
    Empty where rings are not supported."""
    if not supported():
        return {}
    remove_stale_segments(instance)
    rings: dict[str, Consumer] = {}
    try:
        for i, peer in enumerate(peers):
            rings[peer] = create(segment_name(instance, f"ring{i}"))
    except BaseException:
        for lane in rings.values():
            lane.close()
        raise
    return rings
