"""The encoder's work: dedup, decode, batch, encode, store, announce.

All bookkeeping (index, single-flight, queues) happens on the event loop
thread; decoding runs in a thread pool and the vision forward in one compute
thread, so the loop keeps taking messages while a batch runs. Decoding of the
next batch overlaps the current forward.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass

import torch

from pipeline import protocol
from pipeline.arena.index import ArenaBusy, ArenaFull, Entry, State
from pipeline.arena.store import ArenaStore
from pipeline.device_loss import raise_if_lost
from pipeline.encoder.aborts import drop_aborted
from pipeline.encoder.backpressure import ArenaSpace, decode_room
from pipeline.encoder.batching import take_batch
from pipeline.encoder.periodic import expiry_loop, profile_loop, watchdog_loop
from pipeline.encoder.ring_lanes import RingLanes
from pipeline.encoder.single_flight import SingleFlight
from pipeline.encoder.vision_run import Decoded, VisionRun
from pipeline.hashing import content_hash, media_salt
from pipeline.incarnations import Incarnations
from pipeline.media.base import DecodedImage, MediaBackend
from pipeline.media.video_backend import PyAVVideoBackend, VideoBackend, VideoClip
from pipeline.media.video_probe import VideoDecodeError
from pipeline.processing.image import ImageDecodeError, ImageProcessorConfig
from pipeline.processing.video import VideoOptions, video_settings_key
from pipeline.processing.video_config import VideoProcessorConfig
from pipeline.prefill_signal import PrefillHold
from pipeline.watchdog import HangWatchdog

log = logging.getLogger("epd.encoder")


@dataclass(frozen=True)
class EncoderSettings:
    encoder_id: str
    address: str
    model_id: str
    max_batch_tokens: int = 16384
    expiry_interval: float = 1.0


def job_video_options(job: protocol.EncodeJob) -> VideoOptions | None:
    """The request's own sampling of this clip (ValueError if invalid)."""
    if job.video_fps is None and job.video_frames is None:
        return None
    return VideoOptions(job.video_fps, job.video_frames)


class EncoderService:
    def __init__(self, settings: EncoderSettings, store: ArenaStore, tower: torch.nn.Module,
                 media: MediaBackend, image_config: ImageProcessorConfig,
                 send: Callable[[str, protocol.Message], bool],
                 decode_pool: Executor, compute_pool: Executor,
                 forward: Callable[[torch.Tensor, list], list[torch.Tensor]] | None = None,
                 video_config: VideoProcessorConfig | None = None,
                 video_media: VideoBackend | None = None, watchdog: HangWatchdog | None = None,
                 prefill_hold: PrefillHold | None = None) -> None:
        self.settings = settings
        self.store = store
        self.tower = tower
        # forward: e.g. VisionGraphs(tower), the same outputs replayed; run on the compute thread.
        self.vision = VisionRun(store, forward or tower, settings.max_batch_tokens, prefill_hold)
        self.media = media
        self.image_config = image_config
        self.send = send
        self.lanes = RingLanes(send, settings.encoder_id)
        self.decode_pool = decode_pool
        self.compute_pool = compute_pool
        self.video_config = video_config   # None: this model takes no video
        self.video_media = video_media or PyAVVideoBackend()
        self.salt = media_salt(settings.model_id, image_config.settings_key())
        self.flight: SingleFlight[protocol.EncodeJob] = SingleFlight()
        self.to_decode: deque[tuple[str, protocol.EncodeJob]] = deque()
        self.decoded: deque[Decoded] = deque()
        self.counters: Counter[str] = Counter()
        self.incarnation = protocol.new_incarnation()
        self.consumers = Incarnations()   # of the generators, from their hellos and heartbeats
        self.busy: Counter[str] = Counter()   # seconds and images per window, for the profile log
        self.busy_totals: Counter[str] = Counter()   # the same since start, for /metrics
        self._decode_wake = asyncio.Event()
        self._compute_wake = asyncio.Event()
        self.space = ArenaSpace()   # waits for arena room (backpressure.py)
        # A forward stuck past its timeout, or this event loop: the process exits (watchdog.py).
        self.watchdog = watchdog or HangWatchdog(None)
        self.forwarding = False
        self.device = next(tower.parameters()).device   # asked after a failed batch (device_loss.py)

    # ------------------------------------------------------------- messages

    def handle(self, message: protocol.Message) -> None:
        """React to one inbox message; never blocks."""
        if isinstance(message, protocol.EncodeJob):
            self._on_job(message)
        elif isinstance(message, protocol.FetchEmbedding):
            self._on_fetch(message)
        elif isinstance(message, protocol.ReleaseLease):
            for lease_id in message.lease_ids:
                self.store.index.release(lease_id)
            self.space.freed()
        elif isinstance(message, protocol.Heartbeat):
            self._note_consumer(message.sender, message.incarnation, message.started_at)
            self.store.index.heartbeat(message.sender)
        elif isinstance(message, protocol.Hello):
            self._note_consumer(message.sender, message.incarnation, message.started_at)
            self.lanes.on_hello(message)
            self.handle_hello(message.reply_to)
        elif isinstance(message, protocol.StatsRequest):
            self.send(message.reply_to, self.stats())
        elif isinstance(message, protocol.AbortRequest):
            drop_aborted(self, set(message.request_ids))
        else:
            log.warning("ignoring unexpected %s", type(message).__name__)

    def _note_consumer(self, address: str, incarnation: str, started_at: float) -> None:
        """A consumer restarted in place keeps heartbeating under its address,
        so its predecessor's leases would never expire: drop them here."""
        if self.consumers.restarted(address, incarnation):
            dropped = self.store.index.drop_owner(address, taken_before=started_at)
            self.space.freed()
            log.warning("consumer %s restarted: dropped %d lease(s) of its predecessor", address, len(dropped))

    def stats(self) -> protocol.StageStats:
        index = self.store.index
        gauges = {"arena_bytes_used": float(index.bytes_used), "arena_leases": float(index.lease_count),
                  "arena_entries": float(len(index.entries)), "arena_capacity": float(self.store.info.capacity),
                  "in_flight": float(len(self.flight))}
        counters = dict(self.counters, forwards=self.vision.forwards, evictions=index.evictions,
                        ring_wakes=self.lanes.wakes)
        totals = self.busy_totals + self.busy   # the open window's share too
        for phase in ("decode", "forward"):
            counters[f"busy_us.{phase}"] = int(totals[f"{phase}_s"] * 1e6)
            counters[f"images.{phase}"] = int(totals[f"{phase}_images"])
        if self.vision.prefill_hold:
            counters["busy_us.held"] = int(totals["held_s"] * 1e6)   # forwards held for a generator's prefill
        return protocol.StageStats("encoder", self.settings.encoder_id, counters, gauges, self.settings.address,
                                   self.incarnation)

    def handle_hello(self, reply_to: str) -> None:
        self.send(reply_to, self.announcement())

    def announcement(self) -> protocol.EncoderAnnounce:
        return protocol.EncoderAnnounce(self.settings.encoder_id, self.settings.address,
                                        self.settings.model_id, self.store.info,
                                        {"image": self.tower.out_dim})

    def _salt(self, job: protocol.EncodeJob) -> bytes | None:
        if job.modality == "image":
            return self.salt
        if job.modality != "video" or self.video_config is None:
            return None
        options = job_video_options(job)
        return media_salt(self.settings.model_id, video_settings_key(self.video_config, options), "video")

    def _on_job(self, job: protocol.EncodeJob) -> None:
        try:
            salt = self._salt(job)
        except ValueError as exc:   # sampling options no video takes
            self._fail(job, f"bad video options: {exc}", retryable=False)
            return
        if salt is None:
            self._fail(job, f"this encoder takes no {job.modality} input", retryable=False)
            return
        key = content_hash(job.media, salt)
        if key != job.content_hash:
            # The address is always ours to compute: a client-chosen id must
            # never make a request receive another image's embedding.
            # The salt holds the image settings too: a proxy given other
            # --mm-processor-kwargs than this encoder lands here as well.
            self._fail(job, "content hash does not match the media bytes and this encoder's image settings "
                       "(are the proxy and the encoders given the same --mm-processor-kwargs?)", retryable=False)
            return
        entry = self.store.index.get(key)
        if entry is not None and entry.state is State.READY:
            self._deliver(job, entry, dedup=True)
        elif self.flight.join(key, job):
            self.to_decode.append((key, job))
            self._decode_wake.set()

    def _on_fetch(self, fetch: protocol.FetchEmbedding) -> None:
        job = protocol.EncodeJob(fetch.job_id, fetch.request_id, fetch.content_hash, b"", fetch.consumer,
                                 fetch.expected_tokens)
        entry = self.store.index.get(fetch.content_hash)
        if entry is not None and entry.state is State.READY:
            self._deliver(job, entry, dedup=True)
        elif fetch.content_hash in self.flight:
            self.flight.join(fetch.content_hash, job)
        else:
            self._fail(job, "embedding no longer in the arena", retryable=True)

    # ------------------------------------------------------------ pipeline

    async def run(self) -> None:
        try:
            await asyncio.gather(self._decode_loop(), self._compute_loop(), expiry_loop(self),
                                 profile_loop(self), watchdog_loop(self))
        finally:
            self.watchdog.stop()

    async def _decode_loop(self) -> None:
        while True:
            await self._decode_wake.wait()
            self._decode_wake.clear()
            room = decode_room(self.settings.max_batch_tokens, sum(d.tokens for d in self.decoded))
            if not self.to_decode or (self.decoded and room <= 0):
                continue   # the compute loop wakes this loop when it takes a batch
            items = take_batch(self.to_decode, lambda item: item[1].expected_tokens, max(room, 1))
            started = time.perf_counter()
            images = [(key, job) for key, job in items if job.modality == "image"]
            videos = [(key, job) for key, job in items if job.modality == "video"]
            await asyncio.gather(self._decode_images(images), self._decode_videos(videos))
            self.busy["decode_s"] += time.perf_counter() - started
            self.busy["decode_images"] += len(items)
            if self.to_decode:
                self._decode_wake.set()

    async def _decode_images(self, items: list[tuple[str, protocol.EncodeJob]]) -> None:
        if not items:
            return
        loop = asyncio.get_running_loop()
        try:
            results = await loop.run_in_executor(
                self.decode_pool, self.media.decode, [job.media for _, job in items], self.image_config)
        except Exception as exc:
            # A backend failure other than a bad image (those come back as
            # ImageDecodeError) fails this batch, not the encoder: ended,
            # the process would meet the same bytes again when its jobs
            # were retried, and a crash loop stops the whole box.
            log.exception("decoding a batch of %d image(s) failed", len(items))
            # Unless the GPU itself is gone: then this process ends, its jobs
            # unanswered, and the proxy sends them to its replacement (only
            # once: a request whose media lose encoders twice fails there).
            raise_if_lost(self.device, exc)
            for key, _ in items:
                self._fail_all(key, f"encoder error while decoding: {exc}", retryable=True)
            return
        for (key, _), result in zip(items, results):
            if isinstance(result, ImageDecodeError):
                self._fail_all(key, f"bad image: {result}", retryable=False)
            else:
                self._queue_decoded(key, result)

    async def _decode_videos(self, items: list[tuple[str, protocol.EncodeJob]]) -> None:
        """This round's clips in one call of the video backend, on a decode
        thread: their planned frames, preprocessed as the checkpoint's
        reference video processor does."""
        keys, clips = [], []
        for key, job in items:
            try:
                clips.append(VideoClip(job.media, job_video_options(job)))
                keys.append(key)
            except ValueError as exc:
                self._fail_all(key, f"bad video options: {exc}", retryable=False)
        if not clips:
            return
        loop = asyncio.get_running_loop()
        try:
            results = await loop.run_in_executor(self.decode_pool, self.video_media.decode, clips,
                                                 self.video_config)
        except Exception as exc:   # as for images: these clips' jobs fail, the encoder goes on
            log.exception("decoding %d video(s) failed", len(clips))
            raise_if_lost(self.device, exc)
            for key in keys:
                self._fail_all(key, f"encoder error while decoding: {exc}", retryable=True)
            return
        for key, video in zip(keys, results):
            if isinstance(video, VideoDecodeError):
                self._fail_all(key, f"bad video: {video}", retryable=False)
            else:
                self._queue_decoded(key, DecodedImage(video.pixel_values, video.plan.grid, video.plan.source_size))

    def _queue_decoded(self, key: str, decoded: DecodedImage) -> None:
        self.decoded.append(Decoded(key, decoded, self.tower.tokens_per_image(decoded.grid)))
        self._compute_wake.set()

    async def _compute_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._compute_wake.wait()
            self._compute_wake.clear()
            while self.decoded:
                budget = 1 if self.vision.prefill_hold else self.settings.max_batch_tokens   # 1: one item
                batch = take_batch(self.decoded, lambda d: d.tokens, budget)
                self._decode_wake.set()   # room for the next decodes
                reserved, waiting = self._reserve(batch)
                self.decoded.extendleft(reversed(waiting))   # the arena is full of leased entries
                if not reserved:
                    if waiting:
                        await self.space.wait(timeout=1.0)   # for a lease to come back
                    continue
                try:
                    started = time.perf_counter()
                    self.watchdog.progress(force=True)
                    self.forwarding = True
                    try:
                        held = await loop.run_in_executor(self.compute_pool, self.vision, reserved)
                    finally:
                        self.forwarding = False
                    self.busy["forward_s"] += time.perf_counter() - started - held
                    self.busy["held_s"] += held
                    self.busy.update(forward_images=len(reserved), forwards=1)   # this window's
                except Exception as exc:  # a failed forward must not stop the encoder, unless its GPU is gone
                    log.exception("vision forward failed")
                    for item, _ in reserved:
                        self.store.index.abort(item.content_hash)
                    raise_if_lost(self.device, exc)   # as after a failed decode: ends unanswered
                    for item, _ in reserved:
                        self._fail_all(item.content_hash, f"encoder error: {exc}", retryable=True)
                    continue
                for item, entry in reserved:
                    self.store.index.mark_ready(item.content_hash)
                    for i, job in enumerate(self.flight.finish(item.content_hash)):
                        self._deliver(job, entry, dedup=i > 0)

    def _reserve(self, batch: list[Decoded]) -> tuple[list[tuple[Decoded, Entry]], list[Decoded]]:
        """(the items given arena room, those that wait for it: the first without room and all after it)."""
        reserved = []
        for i, item in enumerate(batch):
            shape = (item.tokens, self.tower.out_dim)
            try:
                reserved.append((item, self.store.reserve(item.content_hash, shape, self.dtype)))
                self.space.placed(item.content_hash)
            except ArenaBusy as exc:
                if self.space.keep_waiting(item.content_hash):
                    return reserved, batch[i:]
                self._fail_all(item.content_hash, f"{exc} for {self.space.patience_s:g} s", retryable=True)
            except ArenaFull as exc:
                self._fail_all(item.content_hash, str(exc), retryable=True)
        return reserved, []

    @property
    def dtype(self) -> torch.dtype:
        return self.tower.dtype

    # ------------------------------------------------------------- replies

    def _deliver(self, job: protocol.EncodeJob, entry: Entry, dedup: bool) -> None:
        tokens = entry.shape[0]
        if tokens != job.expected_tokens:
            self._fail(job, f"the image has {tokens} visual tokens but its prompt reserved "
                            f"{job.expected_tokens}", retryable=False)
            return
        lease = self.store.index.lease(entry.content_hash, job.consumer, job.request_id)
        ready = protocol.EmbeddingReady(job.job_id, job.request_id, entry.content_hash,
                                        self.store.handle(entry), lease.lease_id, self.settings.encoder_id, dedup)
        if self.lanes.deliver(job.consumer, ready):
            lane = "ring"
        elif self.send(job.consumer, ready):
            lane = "socket"
        else:
            self.store.index.release(lease.lease_id)
            self.counters["failed"] += 1
            return
        self.counters["dedup" if dedup else "encoded"] += 1
        self.counters[f"handoffs.{lane}"] += 1

    def _fail_all(self, key: str, reason: str, retryable: bool) -> None:
        for job in self.flight.finish(key):
            self._fail(job, reason, retryable)

    def _fail(self, job: protocol.EncodeJob, reason: str, retryable: bool) -> None:
        self.counters["failed"] += 1
        failed = protocol.EncodeFailed(job.job_id, job.request_id, job.content_hash, reason, retryable,
                                       self.settings.encoder_id)
        self.send(job.reply_to or job.consumer, failed)
