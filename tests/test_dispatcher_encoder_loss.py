"""Encode jobs whose encoder was lost (it restarted, or went down): sent
again, to the restarted encoder or to another, and a request whose media
keeps losing encoders fails instead of taking them down one after another.
An encoder whose GPU context is lost ends without answering its batch
(pipeline/device_loss.py), so on a one-encoder box this resend is what
keeps the request. test_dispatcher.py's harness: sockets stand in for the
stages, and the test plays their stats."""

from __future__ import annotations

import asyncio
import time

from pipeline import protocol
from test_dispatcher import ENCODER, GENERATORS, dispatching, stats, work

OTHER = "inproc://e1"


def encoder_stats(address: str, incarnation: str) -> protocol.StageStats:
    return protocol.StageStats("encoder", address, {}, {}, address, incarnation)


def test_jobs_held_by_a_restarted_encoder_go_to_it_again_and_a_second_loss_fails_the_request():
    async def scenario():
        async with dispatching(max_attempts=2) as (dispatcher, stages):
            ended = []
            dispatcher.on_finish = lambda flight, delta: ended.append(delta)
            flight = dispatcher.submit(work("r", max_tokens=4))
            assert [j.request_id for j in stages.received(ENCODER)] == ["r"]

            dispatcher._on_message(encoder_stats(ENCODER, "second"))   # it died unanswered and is back
            (again,) = stages.received(ENCODER)
            assert (again.job_id, again.request_id, again.consumer) == ("r/0", "r", flight.generator)
            assert flight.encoder_losses == 1 and not ended

            dispatcher._on_message(encoder_stats(ENCODER, "third"))    # and again: the media may be the cause
            # Not sent again; told to drop it instead.
            assert stages.received(ENCODER) == [protocol.AbortRequest(("r",))] and "r" not in dispatcher.flights
            (delta,) = ended
            assert delta.status == 503 and delta.error == ("the request's media lost its encoder 2 times; "
                                                           "it is not sent again")
            assert all(load == 0 for load in dispatcher.load.values())
            aborts = [m for m in stages.received(flight.generator) if isinstance(m, protocol.AbortRequest)]
            assert [a.request_ids for a in aborts] == [("r",)]   # its generator stops waiting for it

    asyncio.run(scenario())


def test_a_job_whose_encoder_goes_down_moves_to_another_once_and_waits_when_there_is_none():
    async def scenario():
        async with dispatching(encoders=(ENCODER, OTHER), max_attempts=3, stage_timeout=1.0) as (dispatcher, stages):
            flight = dispatcher.submit(work("r", max_tokens=4))
            (first,) = [a for a in (ENCODER, OTHER) if stages.received(a)]
            second = OTHER if first == ENCODER else ENCODER
            for address in GENERATORS + [second]:
                stages.received(address)
            dispatcher.last_seen[first] = time.monotonic() - 5   # silent past the stage timeout
            for _ in range(3):   # every tick sees it down; the job moves once
                dispatcher._handle_down_stages()
            assert [j.request_id for j in stages.received(second)] == ["r"]
            assert flight.encoders["r/0"] == [first, second] and flight.encoder_losses == 1

            dispatcher.last_seen[second] = time.monotonic() - 5   # both down: nowhere left, nothing counted
            for _ in range(3):
                dispatcher._handle_down_stages()
            assert flight.encoder_losses == 1 and "r" in dispatcher.flights
            assert not stages.received(first) and not stages.received(second)

    asyncio.run(scenario())


def test_a_request_past_its_first_token_does_not_lose_anything_to_an_encoder_restart():
    async def scenario():
        async with dispatching(max_attempts=2) as (dispatcher, stages):
            flight = dispatcher.submit(work("r", max_tokens=4))
            stages.received(ENCODER)
            dispatcher._on_message(protocol.TokenDelta("r", (7,), "a"))   # its prefill read the embedding
            dispatcher._on_message(encoder_stats(ENCODER, "second"))
            dispatcher._on_message(encoder_stats(ENCODER, "third"))
            assert stages.received(ENCODER) == [] and flight.encoder_losses == 0 and "r" in dispatcher.flights

    asyncio.run(scenario())
