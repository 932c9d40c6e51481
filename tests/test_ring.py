"""The shared-memory message ring (pipeline/arena/ring.py) and the encoder's
ring lanes: order, refusal (full, too big, stale consumer), the sleep/wake
handshake, a two-process stream checked message by message, and clean-up."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest

from pipeline import protocol
from pipeline.arena import ring
from pipeline.arena.shm import ShmSegment, our_segments, segment_name
from pipeline.encoder.ring_lanes import RingLanes

pytestmark = pytest.mark.skipif(not ring.supported(), reason="rings need x86 store order")


@pytest.fixture
def pair():
    consumer = ring.create(segment_name("test-ring", "ring0"), slots=4, slot_bytes=64)
    producer = ring.attach(consumer.segment.name)
    yield consumer, producer
    producer.close()
    consumer.close()


def test_messages_arrive_in_order_across_wraparound(pair):
    consumer, producer = pair
    got = []
    for i in range(11):    # nearly three times round four slots
        assert producer.push(f"m{i}".encode())
        if i % 3 == 2:
            got += consumer.pop()
    got += consumer.pop()
    assert got == [f"m{i}".encode() for i in range(11)]
    assert producer.written == 11 and consumer.pending() == 0


def test_full_ring_and_oversized_messages_are_refused(pair):
    consumer, producer = pair
    assert producer.max_message == 60
    assert not producer.push(b"x" * 61)
    assert producer.push(b"y" * 60)
    assert all(producer.push(b"z") for _ in range(3))
    assert not producer.push(b"full")
    assert consumer.pop() == [b"y" * 60, b"z", b"z", b"z"]
    assert producer.push(b"room again")


def test_a_consumer_that_stops_reading_goes_stale():
    consumer = ring.create(segment_name("test-ring", "ring1"), slots=4, slot_bytes=64)
    producer = ring.attach(consumer.segment.name, stale_s=0.05)
    try:
        assert producer.push(b"fresh")
        time.sleep(0.1)
        assert not producer.push(b"stale")     # the caller falls back to its socket
        assert consumer.pop() == [b"fresh"]    # reading is being alive
        assert producer.push(b"alive again")
    finally:
        producer.close()
        consumer.close()


def test_sleep_handshake(pair):
    consumer, producer = pair
    assert not producer.consumer_sleeping()
    assert consumer.may_sleep()              # empty: it may block on its socket
    assert producer.push(b"a")
    assert producer.consumer_sleeping()      # so the producer sends a wake-up
    consumer.awake()
    assert not producer.consumer_sleeping()
    assert not consumer.may_sleep()          # a message is waiting: no sleeping
    assert not producer.consumer_sleeping()
    assert consumer.pop() == [b"a"]


def test_attach_refuses_what_is_not_a_ring():
    with pytest.raises(FileNotFoundError):
        ring.attach(segment_name("test-ring", "ring9"))
    for role, size in (("plain", 4096), ("tiny", 10)):    # no ring header, or too small for one
        segment = ShmSegment.create(segment_name("test-ring", role), size)
        try:
            with pytest.raises(ValueError, match="not a message ring"):
                ring.attach(segment.name)
        finally:
            segment.close()
    for name in ("../../etc/passwd", "epd-x-1-ring0/../../y", "not-ours"):
        with pytest.raises(ValueError, match="not a shared-memory segment name"):
            ring.attach(name)
    with pytest.raises(ValueError, match="geometry"):
        ring.create(segment_name("test-ring", "ring8"), slots=4, slot_bytes=12)


def _produce(name: str, count: int) -> None:
    producer = ring.attach(name, stale_s=30)
    for i in range(count):
        message = i.to_bytes(4, "little") * (1 + i % 13)    # sizes vary; content names its number
        while not producer.push(message):
            pass
    producer.close()


def test_two_processes_stream_every_message_intact():
    consumer = ring.create(segment_name("test-ring", "ring2"), slots=8, slot_bytes=64)
    count = 20000
    process = mp.get_context("spawn").Process(target=_produce, args=(consumer.segment.name, count))
    process.start()
    got = 0
    deadline = time.monotonic() + 120
    try:
        while got < count and time.monotonic() < deadline:
            for message in consumer.pop():
                assert message == got.to_bytes(4, "little") * (1 + got % 13), f"message {got} torn or out of order"
                got += 1
        assert got == count
    finally:
        process.join(timeout=30)
        consumer.close()
    assert process.exitcode == 0


def test_create_inbound_replaces_a_dead_incarnations_rings():
    dead_pid = 2 ** 22 + 12345          # above the default pid_max: no such process
    stale = ShmSegment.create(segment_name("test-ring-gen", "ring0", pid=dead_pid), 64)
    stale.owner = False                 # as if its process had died holding it
    stale.close()
    rings = ring.create_inbound("test-ring-gen", ["ipc://a", "ipc://b"])
    try:
        names = {address: lane.segment.name for address, lane in rings.items()}
        assert names == {"ipc://a": segment_name("test-ring-gen", "ring0"),
                         "ipc://b": segment_name("test-ring-gen", "ring1")}
        assert not [n for n in our_segments() if str(dead_pid) in n]
    finally:
        for lane in rings.values():
            lane.close()
    assert not [n for n in our_segments() if n.startswith("epd-test-ring-gen-")]


def test_ring_lanes_deliver_wake_and_detach():
    sent = []
    lanes = RingLanes(lambda address, message: sent.append((address, message)) or True, "enc-0")
    consumer = ring.create(segment_name("test-ring", "ring3"))
    ready = protocol.EmbeddingReady("job", "req", "hash", protocol.ArenaHandle("a", 0, 8, (1, 2), "bfloat16", 1),
                                    "lease", "enc-0")
    try:
        assert not lanes.deliver("ipc://gen", ready)                      # no Hello yet: socket
        lanes.on_hello(protocol.Hello("gen", "ipc://gen", consumer.segment.name, "another host"))
        assert not lanes.deliver("ipc://gen", ready)                      # not our host: socket
        lanes.on_hello(protocol.Hello("gen", "ipc://gen", consumer.segment.name, ring.host_id()))
        assert lanes.deliver("ipc://gen", ready) and sent == []           # awake consumer: no wake-up
        assert consumer.may_sleep() is False                             # it has a message
        assert [protocol.decode(m) for m in consumer.pop()] == [ready]
        assert consumer.may_sleep()
        assert lanes.deliver("ipc://gen", ready)
        assert sent == [("ipc://gen", protocol.Wake("enc-0"))] and lanes.wakes == 1
        lanes.on_hello(protocol.Hello("gen", "ipc://gen"))                # restarted without a ring
        assert not lanes.deliver("ipc://gen", ready)
    finally:
        lanes.close()
        consumer.close()
    assert os.path.exists("/dev/shm") and not [n for n in our_segments() if n.startswith("epd-test-ring-")]
