"""The proxy's dispatcher on its own (and the HTTP app's drain on top of
it): real sockets stand in for the stages, and the test plays their replies."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
import zmq
import zmq.asyncio

from pipeline import protocol, transport
from pipeline.proxy.api_types import ApiError
from pipeline.proxy.dispatcher import Dispatcher, Work, parse_wire_id, wire_id
from pipeline.proxy.server import ProxyApp

GENERATORS = ["inproc://g0", "inproc://g1"]
ENCODER = "inproc://e0"


def test_wire_ids_round_trip():
    assert wire_id("chatcmpl-req-1-2", 0) == "chatcmpl-req-1-2"
    for attempt in (0, 1, 12):
        assert parse_wire_id(wire_id("chatcmpl-req-1-2", attempt)) == ("chatcmpl-req-1-2", attempt)
    assert parse_wire_id("odd~id~x") == ("odd~id~x", 0)


class Stages:
    """PULL sockets at the stages' addresses: what the dispatcher sends them."""

    def __init__(self, ctx: zmq.asyncio.Context, encoders: tuple[str, ...] = (ENCODER,)) -> None:
        plain = zmq.Context.shadow(ctx.underlying)
        self.inboxes = {a: transport.make_socket(plain, zmq.PULL, a, bind=True) for a in GENERATORS + list(encoders)}

    def received(self, address: str) -> list:
        out = []
        while self.inboxes[address].poll(200):
            out.append(protocol.decode(self.inboxes[address].recv()))
        return out

    def close(self) -> None:
        for sock in self.inboxes.values():
            sock.close()


def stats(address: str, incarnation: str) -> protocol.StageStats:
    return protocol.StageStats("generator", address, {}, {}, address, incarnation)


def work(request_id: str, max_tokens: int) -> Work:
    request = protocol.GenerateRequest(request_id, (1, 2, 3), ((1, 1),), ("k",), ((1, 2, 2),),
                                       protocol.Sampling(max_tokens=max_tokens), "inproc://proxy")
    job = protocol.EncodeJob(f"{request_id}/0", request_id, "k", b"img", "", 1, "inproc://proxy")
    return Work(request, [job], 3 + max_tokens)


@contextlib.asynccontextmanager
async def dispatching(encoders: tuple[str, ...] = (ENCODER,), **options):
    """A dispatcher whose stages (the sockets of `Stages`) have all answered
    stats once, as incarnation "first"; closed with them afterwards."""
    ctx = zmq.asyncio.Context()
    stages = Stages(ctx, encoders)
    dispatcher = Dispatcher(ctx, "inproc://proxy", list(encoders), GENERATORS, aggregated=False, **options)
    try:
        for address in GENERATORS + list(encoders):
            dispatcher._on_message(stats(address, "first"))
        yield dispatcher, stages
    finally:
        stages.close()
        await dispatcher.close()
        ctx.term()


def test_a_restarted_generator_gets_its_requests_again_and_stale_tokens_are_dropped():
    async def scenario():
        async with dispatching() as (dispatcher, stages):
            flight = dispatcher.submit(work("r", max_tokens=10))
            home = flight.generator
            (sent,) = stages.received(home)
            assert sent.request_id == "r"
            assert [j.request_id for j in stages.received(ENCODER)] == ["r"]
            dispatcher._on_message(protocol.TokenDelta("r", (7, 8), "ab"))

            # Same address, new process: the flight moves as attempt 1,
            # resuming after the two tokens the client already has.
            dispatcher._on_message(stats(home, "second"))
            to_home, to_other = stages.received(home), stages.received(next(a for a in GENERATORS if a != home))
            # The abort goes first: a restarted generator drops whatever was
            # queued for its predecessor before it may take the new attempt.
            assert isinstance(to_home[0], protocol.AbortRequest) and to_home[0].request_ids == ("r",)
            moved = [m for m in to_home[1:] + to_other if isinstance(m, protocol.GenerateRequest)]
            assert [(m.request_id, m.prompt_token_ids[-2:], m.sampling.max_tokens) for m in moved] == \
                [("r~1", (7, 8), 8)]
            assert [j.request_id for j in stages.received(ENCODER)] == ["r~1"]

            # The old attempt's tokens (a stalled process waking up) are not the client's.
            dispatcher._on_message(protocol.TokenDelta("r", (9,), "z", True, "length"))
            assert flight.token_ids == [7, 8] and "r" in dispatcher.flights
            dispatcher._on_message(protocol.TokenDelta("r~1", (5,), "c", True, "length", 5, 1))
            assert flight.token_ids == [7, 8, 5] and "r" not in dispatcher.flights
            got = [flight.deltas.get_nowait() for _ in range(flight.deltas.qsize())]
            assert [d.token_ids for d in got] == [(7, 8), (5,)]
            assert got[-1].completion_tokens == 3     # the tokens before the move count as completion

            # An unchanged incarnation moves nothing.
            dispatcher.submit(work("s", max_tokens=4))
            for address in GENERATORS:
                stages.received(address)
            dispatcher._on_message(stats(dispatcher.flights["s"].generator, "second"))
            assert dispatcher.flights["s"].attempt == 0
            assert not any(stages.received(a) for a in GENERATORS)

    asyncio.run(scenario())


def test_a_request_that_keeps_losing_its_generator_fails_instead_of_moving_on():
    """Two generators restart under one request in turn: the second time it
    is not sent again (it may be what kills them), it fails with a 503."""
    async def scenario():
        async with dispatching(max_attempts=2) as (dispatcher, stages):
            ended = []
            dispatcher.on_finish = lambda flight, delta: ended.append(delta)
            flight = dispatcher.submit(work("p", max_tokens=10))
            first = flight.generator
            dispatcher._on_message(stats(first, "second"))
            assert flight.attempt == 1 and "p" in dispatcher.flights
            dispatcher._on_message(stats(flight.generator, "third" if flight.generator == first else "second"))
            assert "p" not in dispatcher.flights
            (delta,) = ended
            assert delta.status == 503 and "lost its generator 2 times" in delta.error
            assert flight.deltas.get_nowait() is delta
            assert all(load == 0 for load in dispatcher.load.values())

    asyncio.run(scenario())


def test_a_stopping_proxy_ends_what_outlasts_its_drain_and_sends_nothing_more():
    """The drain over, a request still running ends with a 503 its client can
    read and is stopped at its generator; one still being read (it was not
    sent on yet) is refused instead of sent."""
    async def scenario():
        async with dispatching() as (dispatcher, stages):
            app = ProxyApp(dispatcher, model=None, policy=None, drain_timeout=0.2)
            flight = dispatcher.submit(work("r", max_tokens=10))
            stages.received(flight.generator)
            app.handling = 2     # the handlers of "r" and of "s" below
            started = time.monotonic()
            await app._drain(None)
            assert time.monotonic() - started >= 0.2 and app.stopping
            delta = flight.deltas.get_nowait()
            assert delta.finished and delta.status == 503 and "server stopped" in delta.error
            (abort,) = stages.received(flight.generator)
            assert isinstance(abort, protocol.AbortRequest) and abort.request_ids == ("r",)
            assert not dispatcher.flights and all(load == 0 for load in dispatcher.load.values())
            with pytest.raises(ApiError, match="stopped before this request was sent on"):
                await app._serve(None, None, work("s", max_tokens=4), chat=True)
            assert not dispatcher.flights and not any(stages.received(a) for a in GENERATORS)

    asyncio.run(scenario())
