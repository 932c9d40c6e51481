"""The proxy's dispatcher on its own (and the HTTP app's drain on top of
it): real sockets stand in for the stages, and the test plays their replies."""

from __future__ import annotations

import asyncio
import contextlib
import types
import time

import pytest
import zmq
import zmq.asyncio

from pipeline import protocol, transport
from pipeline.proxy.api_types import ApiError
from pipeline.proxy.dispatcher import Dispatcher
from pipeline.proxy.flights import Work, parse_wire_id, wire_id
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
            # The next generator learns the tokens and how much of their text the client has.
            assert (moved[0].resumed_output, moved[0].resumed_text_sent) == ((7, 8), 2)
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


def look_down(dispatcher: Dispatcher, *addresses: str) -> None:
    """As if their last stats reply came longer ago than the down timeout."""
    for address in addresses:
        dispatcher.last_seen[address] = time.monotonic() - dispatcher.stage_timeout - 1


def test_requests_wait_while_no_generator_is_up_and_go_on_where_they_are_when_it_answers():
    """Both generators late at once (a loaded box): nothing moves or fails;
    the late one answers again and its request just goes on."""
    async def scenario():
        async with dispatching(orphan_timeout=60.0) as (dispatcher, stages):
            flight = dispatcher.submit(work("r", max_tokens=10))
            home = flight.generator
            stages.received(home)
            dispatcher._on_message(protocol.TokenDelta("r", (7,), "a"))
            look_down(dispatcher, *GENERATORS)
            for _ in range(2):
                dispatcher._handle_down_stages()
            assert flight.attempt == 0 and flight.orphaned_at is not None and "r" in dispatcher.flights
            assert flight.deltas.qsize() == 1          # the one token, no error
            assert not any(stages.received(a) for a in GENERATORS)   # no abort, no move

            dispatcher._on_message(stats(home, "first"))   # late, not restarted
            dispatcher._handle_down_stages()
            assert flight.orphaned_at is None and flight.attempt == 0
            dispatcher._on_message(protocol.TokenDelta("r", (8,), "b", True, "length", 3, 2))
            assert flight.token_ids == [7, 8] and not dispatcher.flights

    asyncio.run(scenario())


def test_a_waiting_request_moves_to_a_generator_that_comes_up_or_restarts():
    async def scenario():
        async with dispatching(orphan_timeout=60.0) as (dispatcher, stages):
            first = dispatcher.submit(work("r", max_tokens=10))
            second = dispatcher.submit(work("s", max_tokens=10))
            for address in GENERATORS:
                stages.received(address)
            assert first.generator != second.generator   # the least loaded: one each
            look_down(dispatcher, *GENERATORS)
            dispatcher._handle_down_stages()
            assert first.attempt == second.attempt == 0

            # "r"'s generator comes back restarted: it takes "r" again (it was the only one up).
            dispatcher._on_message(stats(first.generator, "second"))
            assert first.attempt == 1 and first.orphaned_at is None
            moved = [m for m in stages.received(first.generator) if isinstance(m, protocol.GenerateRequest)]
            assert [m.request_id for m in moved] == ["r~1"]
            # Now a generator is up: the other one's waiting request moves to it at the next look.
            dispatcher._handle_down_stages()
            assert second.attempt == 1 and second.generator == first.generator

    asyncio.run(scenario())


def test_a_request_waits_no_longer_than_the_orphan_timeout():
    async def scenario():
        async with dispatching(orphan_timeout=0.2) as (dispatcher, stages):
            ended = []
            dispatcher.on_finish = lambda flight, delta: ended.append(delta)
            flight = dispatcher.submit(work("r", max_tokens=10))
            stages.received(flight.generator)
            look_down(dispatcher, *GENERATORS)
            dispatcher._handle_down_stages()
            assert not ended
            deadline = time.monotonic() + 5
            while not ended and time.monotonic() < deadline:
                await asyncio.sleep(0.05)   # the watch's own pace: it looks every ping interval
                dispatcher._handle_down_stages()
            (delta,) = ended
            assert delta.status == 503 and "no generator is available" in delta.error
            assert time.monotonic() - flight.created >= 0.2
            assert not dispatcher.flights and all(load == 0 for load in dispatcher.load.values())

    asyncio.run(scenario())


def test_a_starting_proxy_listens_once_its_stages_answer_or_its_down_timeout_passes():
    """ProxyApp._start returns (and the port opens) as soon as every stage
    has answered a stats request; with none answering, after stage_timeout."""
    async def start(answer: bool) -> float:
        ctx = zmq.asyncio.Context()
        stages = Stages(ctx)
        dispatcher = Dispatcher(ctx, "inproc://proxy", [ENCODER], GENERATORS, aggregated=False, stage_timeout=1.5)
        app = ProxyApp(dispatcher, model=None, policy=types.SimpleNamespace(allow_http=False), drain_timeout=0)
        try:
            started = time.monotonic()
            task = asyncio.create_task(app._start(None))
            await asyncio.sleep(0)   # it has begun waiting
            assert not task.done()
            if answer:
                *first, last = GENERATORS + [ENCODER]
                for address in first:
                    dispatcher._on_message(stats(address, "first"))
                await asyncio.sleep(0.1)   # several of its polls
                assert not task.done()     # not before the last of them
                dispatcher._on_message(stats(last, "first"))
            await asyncio.wait_for(task, timeout=5)
            return time.monotonic() - started
        finally:
            await app._stop(None)   # closes the dispatcher
            stages.close()
            ctx.term()

    assert asyncio.run(start(answer=True)) < 0.5
    assert 1.5 <= asyncio.run(start(answer=False)) < 3.0
