"""The proxy's side of the stages: sends encode jobs and generate requests,
routes token deltas back to the waiting HTTP handlers, watches stage health.

Failure handling:
- an encode job that fails with a retryable reason, or whose encoder stops
  answering, is sent to the next encoder in the content's rendezvous order;
- a generator that stops answering: its requests move to another generator.
  One that has produced tokens resumes there: the tokens so far are appended
  to its prompt and only the rest is generated, so the client's stream just
  goes on (usage still counts them as completion tokens). The new generator
  learns which tokens those were and how much of their text was sent: text
  the lost one held back (part of a character, the start of a possible stop
  string) still arrives, and a stop string, a grammar and the penalties go
  on across the move;
- a stage restarted faster than the down timeout never looks down, but its
  stats carry a new incarnation: its requests move, or its encode jobs are
  sent again, as if it had been down;
- each move is a new attempt with its own id on the wire (`wire_id`): the
  generator left behind is told to abort the old one, and anything it still
  sends for it (a stalled process that wakes up) is dropped, so no client
  gets a token twice;
- a generator that stops answering while no other generator is up keeps
  its requests for up to `orphan_timeout`: a process that is slow under
  load (its stats late, not lost) goes on with them, one restarted in place
  takes them again, another that comes up gets them; only then do they fail
  (503). A box whose generators all look down at once loses nothing to a
  false alarm, and a one-generator box survives a generator restart;
- a request whose generator is lost `max_attempts` times is not sent again
  but fails (503): the request may be what kills them, and resending it
  would take the generators down one after another; so does one whose
  encode jobs lost their encoder that many times;
- a bad image (non-retryable failure) ends its request with an error;
- a generator that lost an embedding its request still needs (its encoder
  died before it was read, or it was evicted there too) asks for it again
  (EmbeddingWanted): the job is sent again, from the media kept here until
  the request ends, as the first time;
- with `encode_fallback` "local", a job for which no encoder is up goes to
  the request's generator, which encodes the media itself; once an encoder
  answers again, jobs go to the encoders.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

import msgspec
import zmq.asyncio

from pipeline import protocol, transport
from pipeline.incarnations import Incarnations
from pipeline.proxy.api_types import ApiError
from pipeline.proxy.flights import Flight, Work, parse_wire_id, resume_after_output
from pipeline.proxy.routing import encoder_order, least_loaded

log = logging.getLogger("epd.proxy")

ENCODE_FALLBACKS = ("off", "local")


class Dispatcher:
    def __init__(self, ctx: zmq.asyncio.Context, address: str, encoders: list[str], generators: list[str],
                 aggregated: bool, max_in_flight: int = 1024, stage_timeout: float = 3.0,
                 ping_interval: float = 0.5, max_attempts: int = 2, encode_fallback: str = "off",
                 orphan_timeout: float = 60.0) -> None:
        if encode_fallback not in ENCODE_FALLBACKS:
            raise ValueError(f"encode_fallback={encode_fallback!r}: want one of {ENCODE_FALLBACKS}")
        self.address = address
        self.inbox = transport.Inbox(ctx, address)
        self.outbox = transport.Outbox(ctx)
        self.encoders = encoders
        self.generators = generators
        self.aggregated = aggregated
        self.max_in_flight = max_in_flight
        self.stage_timeout = stage_timeout
        self.ping_interval = ping_interval
        self.max_attempts = max_attempts
        self.orphan_timeout = orphan_timeout
        self.encode_fallback = encode_fallback
        self.falling_back = False   # the last job went to a generator: no encoder was up
        self.flights: dict[str, Flight] = {}
        self.load: dict[str, int] = {g: 0 for g in generators}
        self.last_seen: dict[str, float] = {}
        self.incarnations = Incarnations()   # of the stages, from their stats
        # Named in our stats requests: a generator that sees it change drops
        # the requests of our predecessor at this address.
        self.incarnation = protocol.new_incarnation()
        self.stats: dict[str, protocol.StageStats] = {}
        self.on_finish = None   # callback(flight, delta) for metrics
        self._ids = itertools.count()
        self._tasks: list[asyncio.Task] = []

    # ----------------------------------------------------------- lifecycle

    def start(self) -> None:
        self.inbox.listen(self._on_message)
        self._tasks = [asyncio.create_task(self._watch())]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.inbox.close()
        self.outbox.close()

    def up(self, address: str) -> bool:
        seen = self.last_seen.get(address)
        return seen is not None and time.monotonic() - seen < self.stage_timeout

    def healthy(self) -> bool:
        # Generators that encode for themselves serve without encoders.
        needs_encoders = not self.aggregated and self.encode_fallback == "off"
        stages = self.generators + (self.encoders if needs_encoders else [])
        return all(self.up(a) for a in stages)

    # -------------------------------------------------------------- submit

    def submit(self, work: Work) -> Flight:
        if len(self.flights) >= self.max_in_flight:
            raise ApiError("server busy: too many requests in flight, retry later", status=503)
        generator = self._pick_generator(exclude=())
        flight = Flight(work, generator, asyncio.Queue(), created=work.arrived or time.monotonic())
        self.flights[work.request.request_id] = flight
        try:
            self._dispatch(flight)
        except BaseException:
            self.abort(work.request.request_id)   # a request that cannot be sent must not hold a slot
            raise
        return flight

    def _pick_generator(self, exclude) -> str:
        candidates = [g for g in self.generators if self.up(g) and g not in exclude]
        if not candidates:
            raise ApiError("no generator is available", status=503)
        return least_loaded(candidates, self.load)

    def _dispatch(self, flight: Flight) -> None:
        """Send the encode jobs and the generate request at the same time;
        the generator never waits for the proxy to see the embeddings."""
        self.load[flight.generator] += flight.work.cost
        if not self.aggregated:
            for job in flight.work.jobs:
                self._send_job(flight, job, tried=[])
        request = flight.work.request
        if flight.attempt:
            request = msgspec.structs.replace(request, request_id=flight.wire_id)
        self.outbox.try_send(flight.generator, request)

    def _send_job(self, flight: Flight, job: protocol.EncodeJob, tried: list[str]) -> bool:
        target = self._job_target(flight, job, tried)
        if target is None:
            return False
        flight.encoders[job.job_id] = tried + [target]
        # Every other field (modality, a video's sampling) as the request built it.
        job = msgspec.structs.replace(job, request_id=flight.wire_id, consumer=flight.generator,
                                      reply_to=self.address)
        self.outbox.try_send(target, job)
        return True

    def _job_target(self, flight: Flight, job: protocol.EncodeJob, tried: list[str]) -> str | None:
        """The first live encoder in the job's hash order that has not had
        it; with no live one, the request's generator under fallback "local",
        else the first untried encoder (it may be back before it is seen)."""
        order = [e for e in encoder_order(job.content_hash, self.encoders) if e not in tried]
        live = [e for e in order if self.up(e)]
        fallback = not live and self.encode_fallback == "local" and flight.generator not in tried
        if (live or fallback) and fallback != self.falling_back:   # one line per change, not per job
            self.falling_back = fallback
            if fallback:
                log.warning("no encoder is up: generators encode the images themselves (--encode-fallback local)")
            else:
                log.warning("an encoder is up: encode jobs go to the encoders again")
        if fallback:
            return flight.generator
        return (live or order or [None])[0]

    def abort(self, request_id: str) -> bool:
        """End a request here and at its generator; False if it had ended."""
        flight = self.flights.pop(request_id, None)
        if flight is None:
            return False
        self.load[flight.generator] -= flight.work.cost
        abort = protocol.AbortRequest((flight.wire_id,))
        self.outbox.try_send(flight.generator, abort)
        # Encoders drop what they have not begun of its jobs (a disconnect storm sheds their load too).
        holding = {tried[-1] for job in flight.work.jobs
                   if (tried := flight.encoders.get(job.job_id)) and self._job_needed(flight, job)}
        for encoder in sorted(holding - {flight.generator}):
            self.outbox.try_send(encoder, abort)
        return True

    def new_request_id(self) -> str:
        return f"req-{next(self._ids)}-{time.monotonic_ns() % 1_000_000_000}"

    # ------------------------------------------------------------ incoming

    def _on_message(self, message: protocol.Message) -> None:
        if isinstance(message, protocol.TokenDelta):
            self._on_delta(message)
        elif isinstance(message, protocol.EncodeFailed):
            self._on_encode_failed(message)
        elif isinstance(message, protocol.EmbeddingWanted):
            self._on_wanted(message)
        elif isinstance(message, protocol.StageStats):
            self.last_seen[message.address] = time.monotonic()
            self.stats[message.address] = message
            if self.incarnations.restarted(message.address, message.incarnation):
                log.warning("%s restarted: sending again what it held", message.address)
                self._after_restart(message.address)

    def _current(self, wire: str) -> Flight | None:
        """The flight a stage's message is about; None if it ended, or if
        the message is about an earlier attempt of it."""
        request_id, attempt = parse_wire_id(wire)
        flight = self.flights.get(request_id)
        return flight if flight is not None and flight.attempt == attempt else None

    def _on_delta(self, delta: protocol.TokenDelta) -> None:
        flight = self._current(delta.request_id)
        if flight is None:
            return
        if delta.token_ids:
            now = time.monotonic()
            if flight.first_token_at is None:
                flight.first_token_at = now
            elif flight.last_token_at is not None:
                flight.intervals += [(now - flight.last_token_at) / len(delta.token_ids)] * len(delta.token_ids)
            flight.last_token_at = now
        flight.tokens += len(delta.token_ids)
        flight.token_ids += delta.token_ids
        flight.text_sent += len(delta.text)
        if flight.resumed_from:   # counts as the client sees them (each delta's: continuous usage)
            prompt_tokens = delta.prompt_tokens - flight.resumed_from
            delta = msgspec.structs.replace(
                delta, prompt_tokens=prompt_tokens, cached_tokens=min(delta.cached_tokens, prompt_tokens),
                completion_tokens=delta.completion_tokens + flight.resumed_from)
        if delta.finished:
            self.flights.pop(flight.work.request.request_id, None)
            self.load[flight.generator] -= flight.work.cost
            if self.on_finish is not None:
                self.on_finish(flight, delta)
        flight.deltas.put_nowait(delta)

    def _on_encode_failed(self, failed: protocol.EncodeFailed) -> None:
        flight = self._current(failed.request_id)
        if flight is None:
            return
        job = next((j for j in flight.work.jobs if j.job_id == failed.job_id), None)
        if failed.retryable and job is not None and self._send_job(flight, job, flight.encoders.get(job.job_id, [])):
            log.warning("encode job %s failed on %s (%s): sent to another encoder", failed.job_id,
                        failed.encoder_id, failed.reason)
            return
        # The reason names the item ("bad image: ...", "bad video: ...").
        self._fail(flight, f"media could not be encoded: {failed.reason}", 500 if failed.retryable else 400)

    def _on_wanted(self, wanted: protocol.EmbeddingWanted) -> None:
        """Encode again what a generator lost, from the media kept here."""
        flight = self._current(wanted.request_id)
        if flight is None:   # ended here, or an earlier attempt: its generator should drop it
            self.outbox.try_send(wanted.consumer, protocol.AbortRequest((wanted.request_id,)))
            return
        for key in wanted.content_hashes:
            job = next((j for j in flight.work.jobs if j.content_hash == key), None)
            # Not to an encoder that went silent on it, unless there is no other.
            silent = [wanted.encoder] if wanted.encoder else []
            if job is None or not (self._send_job(flight, job, silent) or self._send_job(flight, job, [])):
                self._fail(flight, f"an image embedding was lost ({wanted.reason}) and cannot be encoded again; "
                           "retry the request", 503)
                return
            flight.wanted.add(job.job_id)
        log.warning("request %s: its generator lost %d image embedding(s) (%s): encoding them again",
                    flight.work.request.request_id, len(wanted.content_hashes), wanted.reason)

    def fail_all(self, reason: str, status: int) -> None:
        """End every request in flight with an error (a proxy that stops)."""
        for flight in list(self.flights.values()):
            self._fail(flight, reason, status)

    def _fail(self, flight: Flight, reason: str, status: int) -> None:
        request_id = flight.work.request.request_id
        self.abort(request_id)
        self._end(flight, protocol.TokenDelta(request_id, (), "", True, "error", error=reason, status=status))

    def _end(self, flight: Flight, delta: protocol.TokenDelta) -> None:
        """The last word of a request that its generator did not end."""
        self.flights.pop(flight.work.request.request_id, None)
        if self.on_finish is not None:
            self.on_finish(flight, delta)
        flight.deltas.put_nowait(delta)

    # --------------------------------------------------------------- health

    async def _watch(self) -> None:
        while True:
            for address in self.generators + ([] if self.aggregated else self.encoders):
                self.outbox.try_send(address, protocol.StatsRequest(self.address, self.incarnation))
            await asyncio.sleep(self.ping_interval)
            self._handle_down_stages()

    def _handle_down_stages(self) -> None:
        now = time.monotonic()
        newly_waiting: dict[str, int] = {}
        for flight in list(self.flights.values()):
            if self.up(flight.generator) or flight.generator not in self.last_seen:
                flight.orphaned_at = None   # it answers again: the request goes on where it is
            elif any(self.up(g) for g in self.generators if g != flight.generator):
                self._redispatch(flight)
            elif flight.orphaned_at is None:
                flight.orphaned_at = now
                newly_waiting[flight.generator] = newly_waiting.get(flight.generator, 0) + 1
            elif now - flight.orphaned_at >= self.orphan_timeout:
                self._redispatch(flight)
        for generator, count in newly_waiting.items():   # one line a generator, not one a request
            log.warning("generator %s looks down and no other is up: %d of its request(s) wait up to %.0f s "
                        "for one", generator, count, self.orphan_timeout)
        if not self.aggregated:
            for flight in list(self.flights.values()):
                # Only jobs with somewhere to go: with none, they wait for the encoder's return.
                self._jobs_lost(flight, [(job, tried) for job in flight.work.jobs
                                         if (tried := flight.encoders.get(job.job_id, []))
                                         and not self.up(tried[-1]) and tried[-1] in self.last_seen
                                         and self._job_needed(flight, job)
                                         and self._job_target(flight, job, tried) is not None])

    def _redispatch(self, flight: Flight, exclude_current: bool = True) -> None:
        """Move a flight, as a new attempt, to another generator (or, after
        a restart, to any, the restarted one too)."""
        # A stalled generator stops on this; a restarted one gets it behind
        # anything queued for its predecessor, in the same pipe, and drops that.
        self.outbox.try_send(flight.generator, protocol.AbortRequest((flight.wire_id,)))
        self.load[flight.generator] -= flight.work.cost
        flight.attempt += 1
        flight.orphaned_at = None
        if flight.token_ids:
            left = flight.work.request.sampling.max_tokens - (len(flight.token_ids) - flight.resumed_from)
            if left <= 0:  # only its final message was lost
                self._finish_lost(flight)
                return
            resume_after_output(flight)
        if flight.attempt >= self.max_attempts:
            log.warning("request %s lost its generator %d times: failing it", flight.work.request.request_id,
                        flight.attempt)
            self._end(flight, protocol.TokenDelta(
                flight.work.request.request_id, (), "", True, "error", status=503,
                error=f"the request lost its generator {flight.attempt} times; it is not sent again"))
            return
        try:
            flight.generator = self._pick_generator(exclude=(flight.generator,) if exclude_current else ())
        except ApiError as exc:
            self._end(flight, protocol.TokenDelta(flight.work.request.request_id, (), "", True, "error",
                                                  error=str(exc), status=503))
            return
        log.warning("request %s moved to generator %s", flight.work.request.request_id, flight.generator)
        flight.encoders.clear()
        self._dispatch(flight)

    def _after_restart(self, address: str) -> None:
        """What a stage restarted in place held died with its predecessor:
        its requests move (it may take them again), and the encode jobs it
        had are sent again for requests that have no token yet, and those
        asked for again (the others have read their embeddings)."""
        for flight in list(self.flights.values()):
            if flight.generator == address:
                self._redispatch(flight, exclude_current=False)
            elif not self.aggregated:
                self._jobs_lost(flight, [(job, tried[:-1]) for job in flight.work.jobs
                                         if (tried := flight.encoders.get(job.job_id, []))
                                         and tried[-1] == address and self._job_needed(flight, job)])

    def _jobs_lost(self, flight: Flight, lost: list[tuple[protocol.EncodeJob, list[str]]]) -> None:
        """Send again the jobs of `flight` that an encoder lost (it went down
        or restarted), each passing over the encoders named with it. The
        `max_attempts`-th such loss fails the request (503) instead: its media
        may be what kills them (an encoder whose GPU fails ends unanswered)."""
        if not lost:
            return
        flight.encoder_losses += 1
        if flight.encoder_losses >= self.max_attempts:
            log.warning("request %s lost its encoder %d times: failing it", flight.work.request.request_id,
                        flight.encoder_losses)
            self._fail(flight, f"the request's media lost its encoder {flight.encoder_losses} times; "
                       "it is not sent again", 503)
            return
        for job, tried in lost:
            self._send_job(flight, job, tried)

    @staticmethod
    def _job_needed(flight: Flight, job: protocol.EncodeJob) -> bool:
        """Whether the generator may still need the job's embedding: none
        before the request's first token (its prefill has not ended), and
        after it only one it asked for again (a preemption evicted it)."""
        return flight.first_token_at is None or job.job_id in flight.wanted

    def _finish_lost(self, flight: Flight) -> None:
        request = flight.work.request
        prompt = len(request.prompt_token_ids) - flight.resumed_from
        self._end(flight, protocol.TokenDelta(request.request_id, (), "", True, "length", prompt,
                                              len(flight.token_ids)))
