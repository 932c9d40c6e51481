"""Property-based tests of every inbox's message decoding.

Each stage decodes every frame it receives with `protocol.decode`: the
encoder's and the proxy's through transport.Inbox (recv() and listen()), the
generator's on its receiver thread (stages/generator.py `receive`) and from
its same-host rings (GeneratorService._drain_rings, frames popped from
pipeline/arena/ring.py). Fed random bytes, random msgpack values and mutated
valid frames, decode either returns a declared message whose fields all have
their declared types, or raises an error the stages catch and drop the frame
for; the receive paths drop such frames and keep serving.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from contextlib import contextmanager
from types import SimpleNamespace

import msgspec
import pytest
import zmq
import zmq.asyncio
from hypothesis import given
from hypothesis import strategies as st

from fuzz_helpers import bounded, fuzz
from message_strategies import CAUGHT, MESSAGE_TYPES, check_decode, frames, messages, msgpack_values
from pipeline import protocol, transport
from pipeline.arena import ring
from pipeline.arena.shm import segment_name
from pipeline.generator.internal import AskerRestarted
from pipeline.generator.service import GeneratorService
from stages.generator import receive

WAIT_S = 10.0


# ---------------------------------------------------------------- decode itself

def test_msgspec_errors_derive_from_what_the_inboxes_catch():
    assert issubclass(msgspec.DecodeError, CAUGHT) and issubclass(msgspec.ValidationError, msgspec.DecodeError)


@fuzz(200)
@given(message=messages)
def test_every_declared_message_round_trips(message):
    data = protocol.encode(message)
    assert check_decode(data) is not None
    assert protocol.encode(protocol.decode(data)) == data


@fuzz(300)
@given(data=frames)
def test_any_frame_decodes_to_a_declared_message_or_a_caught_error(data):
    check_decode(data)


@fuzz(100)
@given(value=msgpack_values)
def test_random_msgpack_values_decode_or_fail_cleanly(value):
    check_decode(msgspec.msgpack.encode(value))


@pytest.mark.parametrize("data, decodes_to", [
    (b"", None), (b"\xc1", None),                                   # nothing; a reserved opcode
    (b"\xdd\xff\xff\xff\xff", None), (b"\xdf\xff\xff\xff\xff", None),  # huge array/map lengths, no body
    (b"\xc6\xff\xff\xff\xff", None), (b"\xdb\xff\xff\xff\xff", None),  # huge bin/str lengths, no body
    (b"\x91" * 100_000 + b"\xc0", None),                             # deep nesting
    (msgspec.msgpack.encode(["heartbeat", "a", 2**64 - 1]), protocol.Heartbeat),   # an int where a float goes
    (msgspec.msgpack.encode(["delta", "r", [True], "x"]), None),     # a bool where an int goes
    (msgspec.msgpack.encode(["encode", "j", "r", "h", "not bytes", "c", 1]), None),
    (msgspec.msgpack.encode(["announce", "e", "a", "m", ["a", "k", 1, 1, "g"], {"image": 1.5}]), None),
    (msgspec.msgpack.encode(["stats", "s", "i", {1: 2}, {}]), None),   # a non-str key
    (msgspec.msgpack.encode(["wake", "w", "a field from a newer peer"]), protocol.Wake),
])
def test_edge_frames(data, decodes_to):
    started = time.monotonic()
    message = check_decode(data)
    assert time.monotonic() - started < 1.0
    assert (None if message is None else type(message)) is decodes_to


# ---------------------------------------------------------------- the receive paths

@contextmanager
def inbox_pair():
    """An asyncio Inbox (the encoder's and the proxy's) and a socket into it."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)   # the asyncio sockets' futures belong to it
    ctx = zmq.asyncio.Context()
    address = f"inproc://fuzz-inbox-{id(loop)}"
    inbox = transport.Inbox(ctx, address)
    sender = transport.make_socket(zmq.Context.shadow(ctx.underlying), zmq.PUSH, address, bind=False)
    try:
        yield loop, inbox, sender
    finally:
        sender.close()
        inbox.close()
        ctx.term()
        asyncio.set_event_loop(None)
        loop.close()


def test_the_encoder_inbox_drops_bad_frames_and_keeps_serving():
    """Inbox.recv(), the encoder's loop: every bad frame counted and dropped,
    every good one returned, in order."""
    with inbox_pair() as (loop, inbox, sender):
        @fuzz(60)
        @given(batch=st.lists(frames, max_size=6))
        def check(batch):
            expected = [m for m in map(check_decode, batch) if m is not None]
            rejected = inbox.rejected
            sentinel = protocol.Wake(f"sentinel-{time.monotonic_ns()}")
            for data in batch + [protocol.encode(sentinel)]:
                sender.send(data)
            got = [loop.run_until_complete(asyncio.wait_for(inbox.recv(), WAIT_S))
                   for _ in range(len(expected) + 1)]
            assert [protocol.encode(m) for m in got] == [protocol.encode(m) for m in expected + [sentinel]]
            assert inbox.rejected - rejected == len(batch) - len(expected)

        check()


def test_the_proxy_inbox_drops_bad_frames_and_keeps_serving():
    """Inbox.listen(), the proxy's: the handler sees only declared messages,
    one that raises does not stop the inbox."""
    with inbox_pair() as (loop, inbox, sender):
        seen: list[protocol.Message] = []

        def handle(message):
            seen.append(message)
            if isinstance(message, protocol.TokenDelta):
                raise RuntimeError("a handler's bug")   # logged; the inbox goes on

        async def start():
            inbox.listen(handle)

        loop.run_until_complete(start())

        @fuzz(60)
        @given(batch=st.lists(frames, max_size=6))
        def check(batch):
            seen.clear()
            sentinel = protocol.Wake(f"sentinel-{time.monotonic_ns()}")
            for data in batch + [protocol.encode(sentinel)]:
                sender.send(data)

            async def until_sentinel():
                while not seen or seen[-1] != sentinel:
                    await asyncio.sleep(0.001)

            loop.run_until_complete(asyncio.wait_for(until_sentinel(), WAIT_S))
            expected = [m for m in map(check_decode, batch) if m is not None]
            assert [protocol.encode(m) for m in seen[:-1]] == [protocol.encode(m) for m in expected]

        check()


class _Replies:
    """The receiver thread's Outbox, recording instead of connecting."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, protocol.Message]] = []

    def try_send(self, address: str, message: protocol.Message) -> bool:
        self.sent.append((address, message))
        return True


@contextmanager
def generator_receiver(replies):
    """stages/generator.py's receiver thread on an inproc socket, with a
    stand-in service (stats to answer with; disaggregated: no image decoding,
    no tower for fallback encodes)."""
    ctx = zmq.Context()
    address = f"inproc://fuzz-generator-{id(ctx)}"
    inbox = transport.make_socket(ctx, zmq.PULL, address, bind=True)
    sender = transport.make_socket(ctx, zmq.PUSH, address, bind=False)
    inbound: queue.SimpleQueue = queue.SimpleQueue()
    stop = threading.Event()
    service = SimpleNamespace(latest_stats=protocol.StageStats("generator", "g0", {}, {}), decode_images=None,
                              local=None)
    thread = threading.Thread(target=receive, args=(inbox, inbound, stop, service, replies), daemon=True)
    thread.start()
    try:
        yield sender, inbound, thread
    finally:
        stop.set()
        thread.join(WAIT_S)
        sender.close()
        inbox.close()
        ctx.term()


def _until(inbound: queue.SimpleQueue, thread: threading.Thread, sentinel: protocol.Wake) -> list:
    """What the receiver passed on, up to the sentinel; fails if the thread died."""
    got, deadline = [], time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            item = inbound.get(timeout=0.01)
        except queue.Empty:
            assert thread.is_alive(), "the receiver thread died"
            continue
        if item == sentinel:
            return got
        got.append(item)
    raise AssertionError("the sentinel never came through")


def test_the_generator_receiver_drops_bad_frames_and_keeps_serving():
    replies = _Replies()
    with generator_receiver(replies) as (sender, inbound, thread):
        @fuzz(60)
        @given(batch=st.lists(frames, max_size=6))
        def check(batch):
            replies.sent.clear()
            sentinel = protocol.Wake(f"sentinel-{time.monotonic_ns()}")
            for data in batch + [protocol.encode(sentinel)]:
                sender.send(data)
            passed = _until(inbound, thread, sentinel)
            expected = [m for m in map(check_decode, batch) if m is not None]
            stats = [m for m in expected if isinstance(m, protocol.StatsRequest)]
            assert [address for address, _ in replies.sent] == [m.reply_to for m in stats]
            assert all(isinstance(m, AskerRestarted) or type(m) in MESSAGE_TYPES for m in passed)
            assert [protocol.encode(m) for m in passed if not isinstance(m, AskerRestarted)] == [
                protocol.encode(m) for m in expected if not isinstance(m, protocol.StatsRequest)]

        check()


def _slot_bytes(frame: bytes) -> bytes:
    return len(frame).to_bytes(4, "little") + frame


@pytest.mark.skipif(not ring.supported(), reason="rings need x86 store order")
def test_the_generator_rings_drop_bad_messages():
    """Whatever a producer leaves in a ring's slots (garbage lengths and
    bytes), the consumer pops bytes; the generator's drain hands on the
    declared messages among them and drops the rest."""
    consumer = ring.create(segment_name("fuzz-ring", "ring0"), slots=4, slot_bytes=64)
    producer = ring.attach(consumer.segment.name, stale_s=60.0)
    handled: list[protocol.Message] = []
    drainer = SimpleNamespace(rings={"enc": consumer}, handle=handled.append)
    try:
        @fuzz(100)
        @given(slots=st.lists(st.binary(max_size=64)
                              | frames.filter(lambda f: len(f) <= producer.max_message).map(_slot_bytes),
                              min_size=1, max_size=4))
        def check(slots):
            # Written as a broken producer would: raw slot bytes, then the count.
            start = consumer.written
            for seq, raw in enumerate(slots, start):
                at = ring._HEADER + (seq % consumer.slots) * consumer.slot_bytes
                consumer._view[at:at + len(raw)] = raw
            consumer._header[ring._WRITTEN] = start + len(slots)
            popped = consumer.pop()
            assert len(popped) == len(slots) and all(type(frame) is bytes for frame in popped)
            # The same frames again, by the real producer, through the generator's drain.
            fitting = [frame for frame in popped if len(frame) <= producer.max_message]
            for frame in fitting:
                assert producer.push(frame)
            handled.clear()
            GeneratorService._drain_rings(drainer)
            expected = [m for m in map(check_decode, fitting) if m is not None]
            assert [protocol.encode(m) for m in handled] == [protocol.encode(m) for m in expected]

        check()
    finally:
        producer.close()
        consumer.close()


# ------------------------------------------------- findings, fixed and kept as cases

@pytest.mark.parametrize("address", ["", "not-an-address", "http://proxy:8000"])
def test_a_reply_address_no_socket_can_reach_is_refused_not_raised(address):
    ctx = zmq.Context()
    outbox = transport.Outbox(ctx)
    try:
        assert outbox.try_send(address, protocol.Wake("fuzz")) is False
    finally:
        outbox.close()
        ctx.term()


def test_a_stats_request_with_a_bad_reply_address_does_not_stop_the_generator_receiver():
    ctx = zmq.Context()
    replies = transport.Outbox(ctx)
    try:
        with generator_receiver(replies) as (sender, inbound, thread):
            sender.send(protocol.encode(protocol.StatsRequest("not-an-address")))
            sentinel = protocol.Wake("sentinel")
            sender.send(protocol.encode(sentinel))
            _until(inbound, thread, sentinel)
    finally:
        replies.close()
        ctx.term()


@pytest.mark.skipif(not ring.supported(), reason="rings need x86 store order")
def test_a_count_past_the_ring_size_pops_at_most_a_ring_of_messages():
    consumer = ring.create(segment_name("fuzz-ring", "ring1"), slots=4, slot_bytes=64)
    try:
        consumer._header[ring._WRITTEN] = consumer.written + 1000
        assert len(bounded(consumer.pop, WAIT_S)) <= consumer.slots
    finally:
        consumer.close()
