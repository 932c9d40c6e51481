"""Backpressure instead of memory exhaustion or failures under overload:
an aggregated generator's decoded-media budget (HeldBytes) and its decode
queue's skips of aborted requests (DecodeSkips), a generator's parked
embeddings (ParkedEmbeddings), and the encoder waiting for arena room
instead of failing, with its decoded backlog bounded (in-process, on the
tiny model's vision tower and a real shared-memory arena)."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import torch

from conftest import image_bytes, random_image
from pipeline import protocol
from pipeline.arena.store import ArenaStore
from pipeline.encoder.backpressure import DECODED_BACKLOG_BATCHES
from pipeline.encoder.service import EncoderService, EncoderSettings
from pipeline.engine.engine import Engine
from pipeline.generator.internal import DecodeSkips
from pipeline.generator.media_budget import HeldBytes
from pipeline.generator.parking import ParkedEmbeddings
from pipeline.hashing import content_hash
from pipeline.media.registry import create_backend
from pipeline.models.loader import load_model
from pipeline.processing.image import ImageProcessorConfig


def test_held_media_wait_for_earlier_ones_to_be_freed():
    budget = HeldBytes(1000)
    first = torch.zeros(200)                      # 800 bytes
    assert budget.hold([first]) and budget.held == 800
    second, done = torch.zeros(100), threading.Event()   # 400 more: over the budget until `first` goes
    worker = threading.Thread(target=lambda: budget.hold([second]) and done.set())
    worker.start()
    assert not done.wait(0.2) and budget.held == 800
    del first                                     # the engine dropped its request's inputs
    assert done.wait(5.0) and budget.held == 400
    worker.join()
    del second
    assert budget.held == 0
    huge = torch.zeros(1000)                      # larger than the whole budget: alone, it passes
    assert budget.hold([huge]) and budget.held == 4000
    stop = threading.Event()
    stop.set()
    assert budget.hold([torch.zeros(1)], stop) is False and budget.held == 4000   # stopping: not counted


def test_an_aborted_request_skips_its_decode_and_only_queued_ones_are_remembered():
    skips = DecodeSkips()
    skips.add("a")
    skips.add("b")
    skips.abort(["a", "never-queued"])
    assert skips.take("a") is True and skips.take("b") is False
    assert skips.queued == set() and skips.aborted == set()
    skips.abort(["b"])                            # already taken by its worker: nothing to skip
    assert skips.aborted == set()


def fake_engine(used: int, capacity: int, pending_rows: list[int]):
    cache = SimpleNamespace(used_tokens=used, capacity_tokens=capacity)
    pending = {f"p{i}": (torch.zeros(rows, 2), 0.0) for i, rows in enumerate(pending_rows)}
    state = SimpleNamespace(scheduler=SimpleNamespace(encoder_cache=cache), pending_embeddings=pending)
    # Engine.has_room_for's own arithmetic, over these numbers (parking asks only that).
    return SimpleNamespace(has_room_for=lambda tokens: Engine.has_room_for(state, tokens))


def announcement(request_id: str, key: str, rows: int) -> protocol.EmbeddingReady:
    handle = protocol.ArenaHandle("arena", 0, rows * 8, (rows, 2), "float32", 1)
    return protocol.EmbeddingReady(f"{request_id}/0", request_id, key, handle, f"lease-{request_id}", "enc")


def test_parked_embeddings_leave_in_arrival_order_when_the_cache_has_room():
    parking = ParkedEmbeddings()
    big, small = announcement("r1", "k1", 60), announcement("r2", "k2", 5)
    assert parking.has_room(fake_engine(90, 100, []), big)          # nothing pending: always
    assert not parking.has_room(fake_engine(30, 100, [20]), big)    # 30 + 20 + 60 > 100
    parking.park(big)
    parking.park(small)
    assert parking.keys == {"k1", "k2"}
    assert parking.next_fitting(fake_engine(30, 100, [20])) is None   # the small one waits behind the big one
    assert parking.next_fitting(fake_engine(30, 100, [5])) is big
    assert parking.next_fitting(fake_engine(30, 100, [10, 60])) is None   # 30 + 70 + 5 > 100
    assert [r.request_id for r in parking.drop_gone(lambda r: r.request_id == "r2")] == ["r2"]
    assert len(parking) == 0 and parking.keys == set()


def test_the_encoder_waits_for_arena_room_and_bounds_its_decoded_backlog(tiny_dir):
    """An arena with room for one embedding, its one entry leased: later jobs
    wait (none fails), decoding stops DECODED_BACKLOG_BATCHES ahead, and
    every job is served once leases come back; one that waits past the
    patience fails, retryably."""
    tower = load_model(tiny_dir, dtype="float32", device="cpu", part="visual").model
    config = ImageProcessorConfig.from_checkpoint(tiny_dir)
    media = create_backend("pillow", torch.device("cpu"))
    images = [image_bytes(random_image(56, 56, seed=seed)) for seed in range(8)]
    (decoded,) = media.decode([images[0]], config)
    tokens = tower.tokens_per_image(decoded.grid)
    block = 4096
    one_entry = -(-tokens * tower.out_dim * 4 // block) * block
    store = ArenaStore(one_entry, block, torch.device("cpu"), "test-backpressure")
    sent: list = []

    async def scenario():
        with ThreadPoolExecutor(1) as decode_pool, ThreadPoolExecutor(1) as compute_pool:
            settings = EncoderSettings("enc", "inproc://enc", "tiny", max_batch_tokens=tokens)
            service = EncoderService(settings, store, tower, media, config,
                                     lambda address, message: sent.append(message) or True, decode_pool, compute_pool)
            running = asyncio.ensure_future(service.run())

            async def until(condition, timeout_s=20.0):
                deadline = time.monotonic() + timeout_s
                while not condition():
                    assert time.monotonic() < deadline, "condition not met in time"
                    await asyncio.sleep(0.005)

            def outcomes(kind):
                return [m for m in sent if isinstance(m, kind)]

            for i, data in enumerate(images):
                service.handle(protocol.EncodeJob(f"j{i}", f"r{i}", content_hash(data, service.salt), data,
                                                  "inproc://gen", tokens, "inproc://proxy"))
            await until(lambda: len(outcomes(protocol.EmbeddingReady)) == 1)
            backlog = DECODED_BACKLOG_BATCHES * tokens
            await until(lambda: sum(d.tokens for d in service.decoded) >= backlog)
            assert sum(d.tokens for d in service.decoded) <= backlog + tokens   # one batch's overshoot at most
            assert len(service.to_decode) >= 1 and not outcomes(protocol.EncodeFailed)
            released = 0
            while released < len(images):                 # the generator reads and gives back, one by one
                await until(lambda: len(outcomes(protocol.EmbeddingReady)) > released)
                ready = outcomes(protocol.EmbeddingReady)[released]
                service.handle(protocol.ReleaseLease((ready.lease_id,), "inproc://gen"))
                released += 1
            assert sorted(m.job_id for m in outcomes(protocol.EmbeddingReady)) == sorted(f"j{i}" for i in range(8))
            assert not outcomes(protocol.EncodeFailed) and store.index.lease_count == 0

            service.space.patience_s = 0.2                # now one that never gets room
            hold = outcomes(protocol.EmbeddingReady)[-1]
            service.handle(protocol.FetchEmbedding("hold", "rh", hold.content_hash, "inproc://gen", tokens))
            late = image_bytes(random_image(56, 56, seed=99))
            service.handle(protocol.EncodeJob("late", "rl", content_hash(late, service.salt), late,
                                              "inproc://gen", tokens, "inproc://proxy"))
            await until(lambda: outcomes(protocol.EncodeFailed))
            failed, = outcomes(protocol.EncodeFailed)
            assert failed.job_id == "late" and failed.retryable and "for 0.2 s" in failed.reason
            running.cancel()

    try:
        asyncio.run(scenario())
    finally:
        store.close()
