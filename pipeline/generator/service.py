"""The generator's engine thread: messages in, engine steps, deltas out.

Runs on one thread that owns the engine, the arena reader and the outgoing
sockets; a receiver thread only decodes frames into `inbound`. Each turn
(`run_once`): apply every queued message (dispatch.py), take in the
embeddings that can be read (intake.py), fail requests whose images are
overdue, run one engine step, send the deltas. The requests served, and the
ids remembered after they are gone, are the request table (requests.py).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable

import msgspec
import torch

from pipeline import protocol
from pipeline.arena import ring
from pipeline.arena.reader import ArenaReader
from pipeline.engine.engine import Engine
from pipeline.engine.output import RequestOutput, Resumed
from pipeline.sampling_params import SamplingParams
from pipeline.models.spec import span_rows
from pipeline.generator.arena_waits import ArenaWaits
from pipeline.generator.dispatch import dispatch, handler_table
from pipeline.generator.early_arrivals import EarlyArrivals
from pipeline.generator.intake import finish_copies, give_everything_back, unpark
from pipeline.generator.key_sources import KeySources
from pipeline.generator.local_encode import LocalEncoder, encode_local
from pipeline.generator.parking import ParkedEmbeddings
from pipeline.generator.refetch import Refetches, expire_refetches, lost_handles, refetch_evicted
from pipeline.generator.requests import RequestTable
from pipeline.generator.stats import generator_stats
from pipeline.logs import STATS_LOGGER
from pipeline.processing.processor import MultimodalPrompt
from pipeline.watchdog import HangWatchdog

log = logging.getLogger("epd.generator")
stats_log = logging.getLogger(STATS_LOGGER)   # --disable-log-stats quiets it


PROFILE_LOG_S = 10.0     # how often the step profile is logged while there is work
STATS_REFRESH_S = 0.05   # how stale the stats the receiver thread answers with may be
EARLY_MEMORY_S = 30.0    # how long an embedding waits for the request it overtook
ARENA_WAIT_S = 10.0      # how long a handle waits for its encoder's arena to open here
KEY_SOURCE_MEMORY_S = 60.0   # how long a key no request needs keeps its encoder's address


class GeneratorService:
    def __init__(self, engine: Engine, address: str, device: torch.device,
                 send: Callable[[str, protocol.Message], bool],
                 encoders: list[str], embedding_timeout: float = 60.0,
                 decode_images: Callable | None = None, heartbeat_interval: float = 1.0,
                 rings: dict[str, ring.Consumer] | None = None, local: LocalEncoder | None = None,
                 watchdog: HangWatchdog | None = None) -> None:
        self.engine = engine
        self.address = address
        self.device = device
        self.send = send
        self.encoders = encoders
        self.embedding_timeout = embedding_timeout
        self.decode_images = decode_images   # aggregated mode: media bytes -> [(pixels, grid)]
        self.local = local   # --encode-fallback local: its own tower, for jobs sent while no encoder is up
        self.heartbeat_interval = heartbeat_interval
        self.watchdog = watchdog or HangWatchdog(None)   # this loop stuck: the process exits (watchdog.py)
        # Same-host encoders put EmbeddingReady here rather than on the socket
        # (pipeline/arena/ring.py): encoder address -> the ring it writes.
        self.rings = rings or {}
        self._host = ring.host_id() if self.rings else ""
        self.requests = RequestTable()
        self.handlers = handler_table(self)
        # The embedding intake's state (intake.py, refetch.py, announcements.py).
        self.reader = ArenaReader(device)
        self.key_sources = KeySources(KEY_SOURCE_MEMORY_S)   # where to refetch an evicted embedding
        self.refetches = Refetches(embedding_timeout)   # keys asked for again (refetch.py)
        self.encoder_addresses: dict[str, str] = {}  # encoder id -> inbox address, from announcements
        self.encoder_arenas: dict[str, str] = {}     # encoder id -> the arena it announced last
        self.waiting_for_arena = ArenaWaits(ARENA_WAIT_S)
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
            self.hello_all()
            while not stop.is_set():
                self.run_once(inbound)
            self.watchdog.stop()
            self.close()
        finally:
            for lane in self.rings.values():
                lane.close()

    def run_once(self, inbound: queue.SimpleQueue, may_block: bool = True) -> None:
        """One turn of the loop. With nothing runnable (no requests, or all
        wait on images) it waits on the inbox briefly, unless `may_block` is off."""
        self.watchdog.progress()
        idle = not self.engine.has_work() or self.engine.last_step_idle
        started = time.perf_counter()
        self._drain_rings()
        # Rings first; block on the socket only if every ring agreed to
        # wake us there (a message that raced in makes it refuse).
        block = may_block and idle and all(lane.may_sleep() for lane in self.rings.values())
        self._drain(inbound, block)
        for lane in self.rings.values():
            lane.awake()
        self._drain_rings()
        finish_copies(self)
        encode_local(self)
        unpark(self)
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

    def close(self) -> None:
        """Give every lease back before leaving."""
        self._drain_rings()     # handles written to us are leased: take them to release them
        give_everything_back(self)
        self.reader.close()

    def hello_all(self) -> None:
        for address in self.encoders:
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

    def handle(self, message) -> None:
        """A protocol message, or one the receiver made (internal.py, local_encode.py)."""
        dispatch(self.handlers, message)

    # ------------------------------------------------------------- requests

    def on_generate(self, req: protocol.GenerateRequest, inputs: list | None = None, error: str = "",
                    error_status: int = 400) -> None:
        """`error`: why its media could not be prepared; `error_status`: 400 for bad media, 500 for a
        decoder that failed."""
        early = self.early.claim(req.request_id)
        if self.requests.was_aborted(req.request_id):
            self.requests.end(req.request_id)   # its late embeddings are given back unread
            return
        self.counters["requests"] += 1
        try:
            self._add_request(req, inputs, error)
        except ValueError as exc:
            self.requests.end(req.request_id)
            self.send(req.reply_to, protocol.TokenDelta(req.request_id, (), "", True, "error", error=str(exc),
                                                        status=error_status if error else 400))
            self.counters["errors"] += 1
            return
        tracked = self.requests.track(req.request_id, req.reply_to, time.monotonic() + self.embedding_timeout)
        for key, embedding in early:
            try:
                self.engine.add_embedding(key, embedding)
            except ValueError as exc:
                self.fail(req.request_id, str(exc), 400)
                return
        if self.decode_images is None:
            tracked.missing = {k for k in req.image_keys
                               if not self.engine.holds_embedding(k) and k not in self.parking.keys}

    def _add_request(self, req: protocol.GenerateRequest, inputs: list | None, error: str) -> None:
        """Into the engine; ValueError for a request it cannot take."""
        if error:
            raise ValueError(error)
        if self.decode_images is not None and req.image_keys and inputs is None:
            raise ValueError("aggregated mode needs the images' bytes in the request")
        params = SamplingParams(**msgspec.structs.asdict(req.sampling))   # the same field names
        prompt = MultimodalPrompt(list(req.prompt_token_ids), [tuple(x) for x in req.image_spans],
                                  [tuple(g) for g in req.grids], tuple(req.seconds_per_grid))
        if inputs is not None:
            # Decoded per item; the engine takes them per placeholder run (a
            # video's runs share its input, as they share its key).
            rows = span_rows(self.engine.model.spec, prompt.grids, prompt.image_spans)
            inputs = [inputs[r.item] for r in rows]
        resumed = Resumed(req.resumed_output, req.resumed_text_sent) if req.resumed_output else None
        self.engine.add_request(req.request_id, prompt, list(req.image_keys), params, inputs, resumed,
                                cache_salt=req.cache_salt, priority=req.priority)

    def release(self, ready: protocol.EmbeddingReady) -> None:
        """Give a handle's lease back unread."""
        encoder = self.encoder_addresses.get(ready.encoder_id)
        if encoder:
            self.send(encoder, protocol.ReleaseLease((ready.lease_id,), self.address))

    def fail_key(self, key: str, reason: str, status: int = 500) -> None:
        """Fail every request here that uses `key`'s embedding."""
        for request_id in list(self.requests.tracked):
            if self.engine.request_image_tokens(request_id, key) is not None:
                self.fail(request_id, reason, status)

    def fail(self, request_id: str, reason: str, status: int = 500) -> None:
        tracked = self.requests.end(request_id)
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
        self.key_sources.prune(now, self.engine.embedding_needed)
        self.requests.expire(now)
        for request_id in self.requests.overdue(now):
            self.fail(request_id, f"image embedding did not arrive within {self.embedding_timeout:g} s", 504)

    def _emit(self, output: RequestOutput) -> None:
        tracked = self.requests.get(output.request_id)
        if tracked is None:
            return
        if output.finished:
            self.requests.end(output.request_id)
        self.send(tracked.reply_to, protocol.TokenDelta(
            output.request_id, output.new_token_ids, output.new_text, output.finished,
            output.finish_reason or "", output.num_prompt_tokens, output.num_output_tokens, logprobs=output.logprobs,
            phases=output.phases, stop_reason=output.stop_reason, cached_tokens=output.num_cached_tokens,
            prompt_logprobs=output.prompt_logprobs))

    # ------------------------------------------------------------ periodic

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
            stats_log.info("step profile %s", json.dumps(window, separators=(",", ":")))

    def _refresh_stats(self) -> None:
        now = time.monotonic()
        if now - self._stats_at >= STATS_REFRESH_S:
            self._stats_at = now
            self.latest_stats = self.stats()

    def stats(self) -> protocol.StageStats:
        return generator_stats(self)
