"""The inbox's two ways of taking messages: awaiting recv(), and listen()
calling a handler from the event loop."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from pipeline import protocol, transport


def _heartbeat(i: int) -> protocol.Heartbeat:
    return protocol.Heartbeat(f"gen-{i}", float(i))


@pytest.fixture
def address(tmp_path):
    return f"ipc://{tmp_path}/inbox.sock"


def test_listen_hands_every_message_over_in_order_and_skips_garbage(address):
    async def main():
        ctx = zmq.asyncio.Context()
        inbox = transport.Inbox(ctx, address)
        sender = transport.make_socket(zmq.Context.shadow(ctx.underlying), zmq.PUSH, address, bind=False)
        got: list[protocol.Message] = []
        # Sent before listen(): the first drain must pick these up, since the
        # descriptor will not signal them again.
        sender.send(protocol.encode(_heartbeat(0)))
        sender.send(b"\x93not a message")
        assert await inbox.socket.poll(5000, zmq.POLLIN)   # they have arrived (poll reads nothing)
        inbox.listen(got.append)
        count = transport.DRAIN_BATCH * 2 + 5   # more than one drain's worth
        for i in range(1, count):
            sender.send(protocol.encode(_heartbeat(i)))
        for _ in range(200):
            if len(got) == count:
                break
            await asyncio.sleep(0.01)
        sender.close()
        inbox.close()
        ctx.term()
        return got, inbox.rejected

    got, rejected = asyncio.run(main())
    assert [m.sender for m in got] == [f"gen-{i}" for i in range(len(got))]
    assert len(got) == transport.DRAIN_BATCH * 2 + 5
    assert rejected == 1


def test_a_handler_that_raises_does_not_stop_the_inbox(address):
    async def main():
        ctx = zmq.asyncio.Context()
        inbox = transport.Inbox(ctx, address)
        sender = transport.make_socket(zmq.Context.shadow(ctx.underlying), zmq.PUSH, address, bind=False)
        got = []

        def handle(message):
            if message.sender == "gen-1":
                raise RuntimeError("boom")
            got.append(message.sender)

        inbox.listen(handle)
        for i in range(3):
            sender.send(protocol.encode(_heartbeat(i)))
        for _ in range(200):
            if len(got) == 2:
                break
            await asyncio.sleep(0.01)
        sender.close()
        inbox.close()
        ctx.term()
        return got

    assert asyncio.run(main()) == ["gen-0", "gen-2"]
