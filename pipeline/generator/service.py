"""The generator's engine thread: messages in, engine steps, deltas out.

Runs on one thread that owns the engine, the arena reader and the outgoing
sockets; a receiver thread only decodes frames into `inbound`. Each turn:
apply every queued message, fail requests whose images are overdue, run one
engine step, send the deltas. Embeddings are copied out of the encoders'
arenas as they arrive, or once there is room for them (parking.py), and
their leases released when the copy is done.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import torch

from pipeline import protocol
from pipeline.arena import ring
from pipeline.arena.reader import ArenaReader, StaleHandleError
from pipeline.engine.engine import Engine
from pipeline.engine.output import RequestOutput
from pipeline.engine.request import SamplingParams
from pipeline.models.spec import span_rows
from pipeline.generator.announcements import on_announce
from pipeline.generator.arena_waits import ArenaWaits
from pipeline.generator.early_arrivals import EarlyArrivals
from pipeline.generator.internal import AskerRestarted, PreparedRequest
from pipeline.generator.key_sources import KeySources
from pipeline.generator.local_encode import DecodedJob, LocalEncoder, encode_local, refuse_job
from pipeline.generator.parking import ParkedEmbeddings
from pipeline.generator.recent_ids import RecentIds
from pipeline.generator.refetch import (Refetches, expire_refetches, handed_back, lost_handles, refetch_evicted,
                                        want_again)
from pipeline.generator.stats import generator_stats
from pipeline.processing.processor import MultimodalPrompt

log = logging.getLogger("epd.generator")


PROFILE_LOG_S = 10.0     # how often the step profile is logged while there is work
STATS_REFRESH_S = 0.05   # how stale the stats the receiver thread answers with may be
ABORT_MEMORY_S = 60.0    # how long an abort waits for a request that has not arrived
ENDED_MEMORY_S = 60.0    # how long an ended request's late embeddings are given back unread
EARLY_MEMORY_S = 30.0    # how long an embedding waits for the request it overtook
ARENA_WAIT_S = 10.0      # how long a handle waits for its encoder's arena to open here
KEY_SOURCE_MEMORY_S = 60.0   # how long a key no request needs keeps its encoder's address


@dataclass
class _Tracked:
    reply_to: str
    missing: set[str]            # image keys not yet delivered
    deadline: float


class GeneratorService:
    def __init__(self, engine: Engine, address: str, device: torch.device,
                 send: Callable[[str, protocol.Message], bool],
                 encoders: list[str], embedding_timeout: float = 60.0,
                 decode_images: Callable | None = None, heartbeat_interval: float = 1.0,
                 rings: dict[str, ring.Consumer] | None = None, local: LocalEncoder | None = None) -> None:
        self.engine = engine
        self.address = address
        self.device = device
        self.send = send
        self.encoders = encoders
        self.embedding_timeout = embedding_timeout
        self.decode_images = decode_images   # aggregated mode: media bytes -> [(pixels, grid)]
        self.local = local   # --encode-fallback local: its own tower, for jobs sent while no encoder is up
        self.heartbeat_interval = heartbeat_interval
        # Same-host encoders put EmbeddingReady here rather than on the socket
        # (pipeline/arena/ring.py): encoder address -> the ring it writes.
        self.rings = rings or {}
        self._host = ring.host_id() if self.rings else ""
        self.reader = ArenaReader(device)
        self.tracked: dict[str, _Tracked] = {}
        self.key_sources = KeySources(KEY_SOURCE_MEMORY_S)   # where to refetch an evicted embedding
        self.refetches = Refetches(embedding_timeout)   # keys asked for again (refetch.py)
        self.encoder_addresses: dict[str, str] = {}  # encoder id -> inbox address, from announcements
        self.encoder_arenas: dict[str, str] = {}     # encoder id -> the arena it announced last
        self.waiting_for_arena = ArenaWaits(ARENA_WAIT_S)
        self.aborted_early = RecentIds(ABORT_MEMORY_S)   # aborts that overtook their requests
        # Requests that ended here: an embedding that comes for one later is given
        # back without a copy, rather than held in memory that no budget counts.
        self.ended = RecentIds(ENDED_MEMORY_S)
        self.early = EarlyArrivals(EARLY_MEMORY_S)   # embeddings that overtook their requests
        self.parking = ParkedEmbeddings()   # announced, left in the arena until there is room here
        self.copies: list = []   # (PendingRead, EmbeddingReady, encoder address) not yet released
        self.counters: Counter[str] = Counter({"requests": 0, "errors": 0, "embeddings": 0, "parked": 0})
        self.incarnation, self.started_at = protocol.new_incarnation(), time.time()
        self._last_heartbeat = 0.0
        # Refreshed by the engine thread each loop; the receiver thread answers
        # stats requests with it, so a long step (a first compile, a big
        # prefill) never makes this generator look dead to the proxy.
        self.latest_stats = self.stats()
        self._stats_at = time.monotonic()
        self._profile_at = time.monotonic()

    # ----------------------------------------------------------------- loop

    def run(self, inbound: queue.SimpleQueue, stop: threading.Event) -> None:
        try:
            self._loop(inbound, stop)
        finally:
            for lane in self.rings.values():
                lane.close()

    def _loop(self, inbound: queue.SimpleQueue, stop: threading.Event) -> None:
        for address in self.encoders:
            self._hello(address)
        while not stop.is_set():
            # Nothing runnable (no requests, or all wait on images): sleep on
            # the inbox instead of spinning the step loop.
            idle = not self.engine.has_work() or self.engine.last_step_idle
            started = time.perf_counter()
            self._drain_rings()
            # Rings first; block on the socket only if every ring agreed to
            # wake us there (a message that raced in makes it refuse).
            self._drain(inbound, block=idle and all(lane.may_sleep() for lane in self.rings.values()))
            for lane in self.rings.values():
                lane.awake()
            self._drain_rings()
            self._finish_copies()
            encode_local(self)
            self._unpark()
            self._expire_overdue()
            self._heartbeat()
            self._refresh_stats()
            self._log_profile()
            if self.engine.has_work():
                # Work between steps (messages, copies, emitting deltas); a
                # blocking wait on an empty inbox is idle time, not counted.
                before = 0.0 if idle else time.perf_counter() - started
                outputs = self.engine.step()
                stepped = time.perf_counter()
                for output in outputs:
                    self._emit(output)
                refetch_evicted(self)
                self.engine.profile.outside_s += before + time.perf_counter() - stepped
        self._drain_rings()     # handles written to us are leased: take them to release them
        for ready in self.parking.drop_gone(lambda _: True):
            self._release(ready)
        for pending, _, _ in self.copies:
            pending.wait()
        self._finish_copies()   # give every lease back before leaving
        self.reader.close()

    def _hello(self, address: str) -> None:
        lane = self.rings.get(address)
        self.send(address, protocol.Hello(self.address, self.address, lane.segment.name if lane else "",
                                          self._host if lane else "", self.incarnation, self.started_at))

    def _drain_rings(self) -> None:
        for lane in self.rings.values():
            for frame in lane.pop():
                try:
                    message = protocol.decode(frame)
                except (ValueError, TypeError):
                    log.warning("dropped a ring message that is not a declared message")
                    continue
                self.handle(message)

    def _drain(self, inbound: queue.SimpleQueue, block: bool) -> None:
        try:
            message = inbound.get(timeout=0.05) if block else inbound.get_nowait()
        except queue.Empty:
            return
        while True:
            self.handle(message)
            try:
                message = inbound.get_nowait()
            except queue.Empty:
                return

    # ------------------------------------------------------------- messages

    def handle(self, message: protocol.Message | PreparedRequest | AskerRestarted) -> None:
        if isinstance(message, PreparedRequest):
            self._on_generate(message.request, message.inputs, message.error)
        elif isinstance(message, protocol.GenerateRequest):
            self._on_generate(message)
        elif isinstance(message, protocol.EmbeddingReady):
            self._on_embedding(message)
        elif isinstance(message, protocol.EncodeFailed):   # from a FetchEmbedding (proxies get their jobs')
            if message.retryable:
                want_again(self, message.content_hash, message.reason)
            else:
                self._fail_key(message.content_hash, f"image encoding failed: {message.reason}", 400)
        elif isinstance(message, DecodedJob):
            self.local.queue.append(message)
        elif isinstance(message, protocol.EncodeJob):   # a receiver without a tower passes them on
            refuse_job(self, message)
        elif isinstance(message, protocol.AbortRequest):
            for request_id in message.request_ids:
                if self.tracked.pop(request_id, None) is None:
                    # Not here yet: an aggregated-mode request is still having
                    # its images decoded on the receiver's worker. Drop it
                    # when it comes.
                    self.aborted_early.add(request_id)
                else:
                    self.ended.add(request_id)
                self.engine.abort(request_id)
        elif isinstance(message, protocol.EncoderAnnounce):
            on_announce(self, message)
        elif isinstance(message, protocol.Wake):
            pass    # it woke the loop, which reads the rings next
        elif isinstance(message, AskerRestarted):
            orphans = [rid for rid, tracked in self.tracked.items() if tracked.reply_to == message.address]
            for request_id in orphans:
                del self.tracked[request_id]
                self.ended.add(request_id)
                self.engine.abort(request_id)
            log.warning("%s restarted: dropped the %d request(s) its predecessor sent", message.address,
                        len(orphans))
        else:
            log.warning("ignoring unexpected %s", type(message).__name__)

    def _on_generate(self, req: protocol.GenerateRequest, inputs: list | None = None, error: str = "") -> None:
        early = self.early.claim(req.request_id)
        if self.aborted_early.pop(req.request_id):
            return
        self.counters["requests"] += 1
        s = req.sampling
        try:
            if error:
                raise ValueError(error)
            if self.decode_images is not None and req.image_keys and inputs is None:
                raise ValueError("aggregated mode needs the images' bytes in the request")
            params = SamplingParams(**msgspec.structs.asdict(s))   # the same field names
            prompt = MultimodalPrompt(list(req.prompt_token_ids), [tuple(x) for x in req.image_spans],
                                      [tuple(g) for g in req.grids], tuple(req.seconds_per_grid))
            if inputs is not None:
                # Decoded per item; the engine takes them per placeholder run (a
                # video's runs share its input, as they share its key).
                rows = span_rows(self.engine.model.spec, prompt.grids, prompt.image_spans)
                inputs = [inputs[r.item] for r in rows]
            self.engine.add_request(req.request_id, prompt, list(req.image_keys), params, inputs)
        except ValueError as exc:
            self.send(req.reply_to, protocol.TokenDelta(req.request_id, (), "", True, "error", error=str(exc),
                                                        status=400))
            self.counters["errors"] += 1
            return
        tracked = self.tracked[req.request_id] = _Tracked(req.reply_to, set(),
                                                          time.monotonic() + self.embedding_timeout)
        for key, embedding in early:
            try:
                self.engine.add_embedding(key, embedding)
            except ValueError as exc:
                self._fail(req.request_id, str(exc), 400)
                return
        if self.decode_images is None:
            tracked.missing = {k for k in req.image_keys if not self.engine.scheduler.embedding_available(k)
                               and k not in self.engine.pending_embeddings and k not in self.parking.keys}

    def _on_embedding(self, ready: protocol.EmbeddingReady, parked_since: float | None = None,
                      unparked: bool = False) -> None:
        if not self.reader.is_open(ready.handle.arena_id):
            # An encoder we have not heard from: ask it, keep the handle (leased) meanwhile.
            if self.waiting_for_arena.park(ready, parked_since):
                for address in self.encoders:
                    self._hello(address)
            return
        if self._request_gone(ready):
            handed_back(self, ready)    # its request is over: nothing here will read it
            return
        self.refetches.answered(ready.content_hash)
        if not unparked and (self.parking.parked or not self.parking.has_room(self.engine, ready)):
            self.parking.park(ready)   # behind those parked before it (pipeline/generator/parking.py)
            self.counters["parked"] += 1
            for tracked in self.tracked.values():
                tracked.missing.discard(ready.content_hash)   # it came: no timeout while it waits here
            return
        encoder = self.encoder_addresses.get(ready.encoder_id, "")
        try:
            # Queued on this thread's stream: the forward that uses it runs after
            # it on the same stream, so nothing here waits for the copy.
            pending = self.reader.read_async(ready.handle, device=self.device)
        except (StaleHandleError, ValueError) as exc:   # reused blocks, or a handle outside the arena
            self.send(encoder, protocol.ReleaseLease((ready.lease_id,), self.address))
            want_again(self, ready.content_hash, f"unreadable: {exc}")
            return
        self.copies.append((pending, ready, encoder))
        self.counters["embeddings"] += 1
        self.key_sources.remember(ready.content_hash, encoder)
        self.take_embedding(ready.request_id, ready.content_hash, pending.tensor)

    def take_embedding(self, request_id: str, key: str, embedding: torch.Tensor) -> None:
        """An embedding is here (copied from an arena, or encoded by this generator)."""
        self.refetches.arrived(key)
        try:
            self.engine.add_embedding(key, embedding)
        except ValueError as exc:
            self._fail_key(key, str(exc), 400)
            return
        for tracked in self.tracked.values():
            tracked.missing.discard(key)
        if request_id not in self.tracked:
            self.early.hold(request_id, key, embedding)

    def _request_gone(self, ready: protocol.EmbeddingReady) -> bool:
        return ready.request_id in self.ended or ready.request_id in self.aborted_early

    def _unpark(self) -> None:
        for ready in self.parking.drop_gone(self._request_gone):
            handed_back(self, ready)
        while (ready := self.parking.next_fitting(self.engine)) is not None:
            self._on_embedding(ready, unparked=True)

    def _finish_copies(self) -> None:
        """Release the leases of copies that have completed (checked against
        the arena's generations first)."""
        still = []
        for pending, ready, encoder in self.copies:
            if not pending.done():
                still.append((pending, ready, encoder))
                continue
            try:
                self.reader.verify(ready.handle)
            except StaleHandleError as exc:
                self._fail_key(ready.content_hash, f"image embedding overwritten while copied: {exc}")
            self.send(encoder, protocol.ReleaseLease((ready.lease_id,), self.address))
        self.copies = still

    # ------------------------------------------------------------- failures

    def _fail_key(self, key: str, reason: str, status: int = 500) -> None:
        for request_id, tracked in list(self.tracked.items()):
            request = self.engine.scheduler.get_request(request_id)
            if request is not None and any(s.key == key for s in request.image_spans):
                self._fail(request_id, reason, status)

    def _release(self, ready: protocol.EmbeddingReady) -> None:
        """Give a handle's lease back unread."""
        encoder = self.encoder_addresses.get(ready.encoder_id)
        if encoder:
            self.send(encoder, protocol.ReleaseLease((ready.lease_id,), self.address))

    def _fail(self, request_id: str, reason: str, status: int = 500) -> None:
        tracked = self.tracked.pop(request_id, None)
        self.ended.add(request_id)
        self.engine.abort(request_id)
        self.counters["errors"] += 1
        if tracked is not None:
            self.send(tracked.reply_to, protocol.TokenDelta(request_id, (), "", True, "error", error=reason,
                                                            status=status))

    def _expire_overdue(self) -> None:
        now = time.monotonic()
        self.early.expire(now)
        lost_handles(self, self.waiting_for_arena.take_overdue(now),
                     f"its encoder's arena was not announced within {ARENA_WAIT_S:g} s")
        expire_refetches(self, now)
        self.key_sources.prune(now, self.engine.scheduler.encoder_cache.is_needed)
        self.aborted_early.expire(now)     # aborts for requests that never came
        self.ended.expire(now)
        for request_id, tracked in list(self.tracked.items()):
            if tracked.missing and now > tracked.deadline:
                self._fail(request_id, f"image embedding did not arrive within {self.embedding_timeout:g} s",
                           504)

    # --------------------------------------------------------------- output

    def _emit(self, output: RequestOutput) -> None:
        tracked = self.tracked.get(output.request_id)
        if tracked is None:
            return
        if output.finished:
            del self.tracked[output.request_id]
            self.ended.add(output.request_id)
        self.send(tracked.reply_to, protocol.TokenDelta(
            output.request_id, output.new_token_ids, output.new_text, output.finished,
            output.finish_reason or "", output.num_prompt_tokens, output.num_output_tokens, logprobs=output.logprobs,
            phases=output.phases))

    def _heartbeat(self) -> None:
        now = time.monotonic()
        if now - self._last_heartbeat >= self.heartbeat_interval:
            self._last_heartbeat = now
            for address in self.encoders:
                self.send(address, protocol.Heartbeat(self.address, time.time(), self.incarnation,
                                                      self.started_at))

    def _log_profile(self) -> None:
        """Every PROFILE_LOG_S with steps in it: one line of where the time went."""
        if time.monotonic() - self._profile_at < PROFILE_LOG_S:
            return
        self._profile_at = time.monotonic()
        window = self.engine.profile.window()
        if any(isinstance(v, dict) and k != "idle" for k, v in window.items()):
            log.info("step profile %s", json.dumps(window, separators=(",", ":")))

    def _refresh_stats(self) -> None:
        now = time.monotonic()
        if now - self._stats_at >= STATS_REFRESH_S:
            self._stats_at = now
            self.latest_stats = self.stats()

    def stats(self) -> protocol.StageStats:
        return generator_stats(self)
