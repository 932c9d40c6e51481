"""The dispatcher's side of issue 19's failover: a generator that lost an
embedding asks for it again (EmbeddingWanted) and the job is sent again from
the media the proxy kept; with --encode-fallback local, jobs go to the
request's generator while no encoder is up. Real sockets stand in for the
stages (tests/test_dispatcher.py's helpers)."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from pipeline import protocol
from pipeline.proxy.dispatcher import Dispatcher
from pipeline.proxy.routing import encoder_order
from test_dispatcher import ENCODER, GENERATORS, dispatching, work

ENCODERS = ("inproc://e0", "inproc://e1")
FALLBACK_ON = "no encoder is up: generators encode the images themselves"
FALLBACK_OFF = "an encoder is up: encode jobs go to the encoders again"


def mark_down(dispatcher: Dispatcher, address: str) -> None:
    dispatcher.last_seen[address] = time.monotonic() - 10 * dispatcher.stage_timeout


def jobs_at(stages, address: str) -> list[protocol.EncodeJob]:
    return [m for m in stages.received(address) if isinstance(m, protocol.EncodeJob)]


def test_a_lost_embedding_is_encoded_again_by_a_live_encoder_from_the_kept_media():
    async def scenario():
        async with dispatching(encoders=ENCODERS) as (dispatcher, stages):
            flight = dispatcher.submit(work("r", max_tokens=4))
            first, second = encoder_order("k", list(ENCODERS))
            assert [j.job_id for j in jobs_at(stages, first)] == ["r/0"] and not jobs_at(stages, second)
            for address in GENERATORS:
                stages.received(address)

            mark_down(dispatcher, first)   # the producer died before the generator read the embedding
            dispatcher._on_message(protocol.EmbeddingWanted("r", ("k",), flight.generator, "unreadable"))
            (again,) = jobs_at(stages, second)
            assert (again.job_id, again.request_id, again.media, again.consumer) == \
                ("r/0", "r", b"img", flight.generator)
            assert not jobs_at(stages, first) and "r" in dispatcher.flights and flight.wanted == {"r/0"}
            assert flight.deltas.empty()

            # The encoder it went to restarts in place after the first token:
            # the job asked for again is sent again, unlike the others.
            dispatcher._on_message(protocol.TokenDelta("r", (5,), "x"))
            for address in ENCODERS:
                dispatcher._on_message(protocol.StageStats("encoder", address, {}, {}, address, "first"))
            dispatcher._on_message(protocol.StageStats("encoder", second, {}, {}, second, "second"))
            assert [j.job_id for j in jobs_at(stages, second) + jobs_at(stages, first)] == ["r/0"]

    asyncio.run(scenario())


def test_an_encoder_that_goes_down_has_only_the_jobs_still_needed_sent_again():
    """Down, its jobs go to a live encoder for requests with no token yet;
    a request that is decoding has read its embeddings: its job is not
    encoded again (and pinned at the generator) as capacity drops."""
    async def scenario():
        async with dispatching(encoders=ENCODERS) as (dispatcher, stages):
            first, second = encoder_order("k", list(ENCODERS))
            dispatcher.submit(work("decoding", max_tokens=4))
            dispatcher.submit(work("waiting", max_tokens=4))
            assert sorted(j.request_id for j in jobs_at(stages, first)) == ["decoding", "waiting"]
            dispatcher._on_message(protocol.TokenDelta("decoding", (5,), "x"))
            mark_down(dispatcher, first)
            dispatcher._handle_down_stages()
            assert [j.request_id for j in jobs_at(stages, second)] == ["waiting"]
            assert {"decoding", "waiting"} <= set(dispatcher.flights)

    asyncio.run(scenario())


def test_an_abort_reaches_the_encoders_still_holding_its_jobs():
    async def scenario():
        async with dispatching(encoders=ENCODERS) as (dispatcher, stages):
            first, _ = encoder_order("k", list(ENCODERS))
            waiting, _ = (dispatcher.submit(work(rid, max_tokens=4)) for rid in ("waiting", "decoding"))
            dispatcher._on_message(protocol.TokenDelta("decoding", (5,), "x"))   # its images are read
            jobs_at(stages, first)
            for rid in ("waiting", "decoding"):
                assert dispatcher.abort(rid)
            aborts = [m for m in stages.received(first) if isinstance(m, protocol.AbortRequest)]
            assert [m.request_ids for m in aborts] == [(waiting.wire_id,)]

    asyncio.run(scenario())


def test_a_wanted_embedding_goes_past_the_encoder_that_went_silent_on_it_unless_there_is_no_other():
    async def scenario():
        async with dispatching(encoders=ENCODERS, stage_timeout=60) as (dispatcher, stages):
            flight = dispatcher.submit(work("r", max_tokens=4))
            first, second = encoder_order("k", list(ENCODERS))
            jobs_at(stages, first)
            # Dead but not yet seen down (a long down timeout): the generator names it.
            dispatcher._on_message(protocol.EmbeddingWanted("r", ("k",), flight.generator, "silent", first))
            assert [j.job_id for j in jobs_at(stages, second)] == ["r/0"] and not jobs_at(stages, first)

        async with dispatching() as (dispatcher, stages):
            flight = dispatcher.submit(work("s", max_tokens=4))
            jobs_at(stages, ENCODER)
            dispatcher._on_message(protocol.EmbeddingWanted("s", ("k",), flight.generator, "silent", ENCODER))
            assert [j.job_id for j in jobs_at(stages, ENCODER)] == ["s/0"] and "s" in dispatcher.flights

    asyncio.run(scenario())


def test_a_wanted_embedding_of_an_ended_request_stops_it_and_an_unknown_one_fails_it():
    async def scenario():
        async with dispatching() as (dispatcher, stages):
            ended = []
            dispatcher.on_finish = lambda flight, delta: ended.append(delta)
            flight = dispatcher.submit(work("r", max_tokens=4))
            generator = flight.generator
            stages.received(generator)
            stages.received(ENCODER)

            # An earlier attempt's id, or a request that is over: its generator drops it.
            dispatcher._on_message(protocol.EmbeddingWanted("r~3", ("k",), generator, "evicted"))
            (abort,) = stages.received(generator)
            assert isinstance(abort, protocol.AbortRequest) and abort.request_ids == ("r~3",)
            assert not stages.received(ENCODER) and "r" in dispatcher.flights

            # A key the request never had: nothing to encode it from, a retryable error.
            dispatcher._on_message(protocol.EmbeddingWanted("r", ("other",), generator, "evicted"))
            assert "r" not in dispatcher.flights
            assert stages.received(ENCODER) == [protocol.AbortRequest(("r",))]   # no job: its own is dropped
            (delta,) = ended
            assert delta.status == 503 and "cannot be encoded again" in delta.error and "retry" in delta.error
            (abort,) = stages.received(generator)
            assert isinstance(abort, protocol.AbortRequest) and abort.request_ids == ("r",)
            assert all(load == 0 for load in dispatcher.load.values())

    asyncio.run(scenario())


def test_with_fallback_local_jobs_go_to_the_generator_while_no_encoder_is_up(caplog):
    caplog.set_level(logging.INFO, logger="epd.proxy")

    async def scenario():
        async with dispatching(encode_fallback="local") as (dispatcher, stages):
            mark_down(dispatcher, ENCODER)
            assert dispatcher.healthy()     # generators that encode serve without encoders
            for rid in ("a", "b"):
                flight = dispatcher.submit(work(rid, max_tokens=4))
                job, request = stages.received(flight.generator)
                assert isinstance(job, protocol.EncodeJob) and isinstance(request, protocol.GenerateRequest)
                assert (job.request_id, job.media, job.consumer, request.media) == (rid, b"img", flight.generator, ())
            assert not stages.received(ENCODER)
            assert caplog.text.count(FALLBACK_ON) == 1 and FALLBACK_OFF not in caplog.text

            dispatcher._on_message(protocol.StageStats("encoder", ENCODER, {}, {}, ENCODER, "first"))
            flight = dispatcher.submit(work("c", max_tokens=4))
            assert [j.request_id for j in jobs_at(stages, ENCODER)] == ["c"]
            assert not jobs_at(stages, flight.generator)
            assert caplog.text.count(FALLBACK_ON) == 1 and caplog.text.count(FALLBACK_OFF) == 1

    asyncio.run(scenario())


def test_without_fallback_a_job_waits_for_a_down_encoder_and_health_says_so():
    async def scenario():
        async with dispatching() as (dispatcher, stages):
            mark_down(dispatcher, ENCODER)
            assert not dispatcher.healthy()
            flight = dispatcher.submit(work("a", max_tokens=4))
            assert [j.request_id for j in jobs_at(stages, ENCODER)] == ["a"]
            assert not jobs_at(stages, flight.generator)

    asyncio.run(scenario())


def test_an_unknown_fallback_is_refused():
    with pytest.raises(ValueError, match="encode_fallback='remote'"):
        Dispatcher(None, "inproc://x", [ENCODER], GENERATORS, aggregated=False, encode_fallback="remote")
