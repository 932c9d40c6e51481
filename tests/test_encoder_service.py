"""The encoder's service loop in-process, on the tiny model's real vision
tower and a real shared-memory arena."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from msgspec.structs import replace as msgspec_replace

from conftest import image_bytes, random_image
from pipeline import protocol
from pipeline.arena.store import ArenaStore
from pipeline.encoder.service import EncoderService, EncoderSettings
from pipeline.hashing import content_hash
from pipeline.media.registry import create_backend
from pipeline.models.loader import load_model
from pipeline.processing.image import ImageProcessorConfig

POISON = b"\x89PNG poison"


class BrokenOnPoison:
    """The Pillow backend, except that a batch holding POISON raises what a
    backend should never raise (as a library bug or an exhausted device would)."""

    def __init__(self) -> None:
        self.real = create_backend("pillow", torch.device("cpu"))

    def decode(self, blobs, cfg):
        if POISON in blobs:
            raise RuntimeError("decoder library crashed")
        return self.real.decode(blobs, cfg)

    def __getattr__(self, name):
        return getattr(self.real, name)


def pillow_service(store, tower, config, sent: list, decode_pool, compute_pool) -> EncoderService:
    """An encoder on the Pillow backend whose messages are appended to `sent`."""
    return EncoderService(EncoderSettings("enc", "inproc://enc", "tiny"), store, tower,
                          create_backend("pillow", torch.device("cpu")), config,
                          lambda address, message: sent.append(message) or True, decode_pool, compute_pool)


def test_a_backend_failure_fails_its_jobs_and_the_encoder_keeps_serving(tiny_dir):
    tower = load_model(tiny_dir, dtype="float32", device="cpu", part="visual").model
    config = ImageProcessorConfig.from_checkpoint(tiny_dir)
    store = ArenaStore(4 << 20, 64 << 10, torch.device("cpu"), "test-encsvc")
    sent: list[tuple[str, protocol.Message]] = []

    def send(address, message):
        sent.append((address, message))
        return True

    async def scenario():
        with ThreadPoolExecutor(1) as decode_pool, ThreadPoolExecutor(1) as compute_pool:
            service = EncoderService(EncoderSettings("enc", "inproc://enc", "tiny"), store, tower,
                                     BrokenOnPoison(), config, send, decode_pool, compute_pool)
            running = asyncio.ensure_future(service.run())

            async def outcome(job_id):
                for _ in range(600):
                    for _, message in sent:
                        if getattr(message, "job_id", None) == job_id:
                            return message
                    await asyncio.sleep(0.01)
                raise TimeoutError(job_id)

            def job(job_id, media, tokens=1):
                return protocol.EncodeJob(job_id, job_id, content_hash(media, service.salt), media, "inproc://gen",
                                          tokens, "inproc://proxy")

            service.handle(job("bad", POISON))
            failed = await outcome("bad")
            assert isinstance(failed, protocol.EncodeFailed) and failed.retryable
            assert "decoder library crashed" in failed.reason
            good = image_bytes(random_image(56, 56, seed=3))
            (decoded,) = service.media.decode([good], config)
            service.handle(job("good", good, tower.tokens_per_image(decoded.grid)))
            ready = await outcome("good")
            assert isinstance(ready, protocol.EmbeddingReady)
            service.handle(protocol.ReleaseLease((ready.lease_id,), "inproc://gen"))
            assert store.index.lease_count == 0
            assert not running.done()
            assert len(service.flight) == 0
            running.cancel()

    try:
        asyncio.run(scenario())
    finally:
        store.close()


def test_leases_of_a_consumer_restarted_in_place_are_dropped(tiny_dir):
    """A generator restarted at the same address heartbeats under that
    address, so its predecessor's leases would never expire: its new
    incarnation drops them, and only them."""
    tower = load_model(tiny_dir, dtype="float32", device="cpu", part="visual").model
    config = ImageProcessorConfig.from_checkpoint(tiny_dir)
    store = ArenaStore(4 << 20, 64 << 10, torch.device("cpu"), "test-encsvc-restart")
    sent: list = []
    gen = "inproc://gen"

    async def scenario():
        with ThreadPoolExecutor(1) as decode_pool, ThreadPoolExecutor(1) as compute_pool:
            service = pillow_service(store, tower, config, sent, decode_pool, compute_pool)
            running = asyncio.ensure_future(service.run())

            async def lease_for(job_id, seed):
                media = image_bytes(random_image(40, 48, seed=seed))
                (decoded,) = service.media.decode([media], config)
                service.handle(protocol.EncodeJob(job_id, job_id, content_hash(media, service.salt), media, gen,
                                                  tower.tokens_per_image(decoded.grid), "inproc://proxy"))
                for _ in range(600):
                    ready = [m for m in sent if isinstance(m, protocol.EmbeddingReady) and m.job_id == job_id]
                    if ready:
                        return ready[0]
                    await asyncio.sleep(0.01)
                raise TimeoutError(job_id)

            service.handle(protocol.Hello(gen, gen, incarnation="first", started_at=time.time()))
            await lease_for("before", 1)
            restarted_at = time.time()
            while time.time() <= restarted_at:   # the "after" lease is stamped later than the restart
                await asyncio.sleep(0)
            after = await lease_for("after", 2)      # a job for the new one, ahead of its first word
            service.handle(protocol.Heartbeat(gen, time.time(), "second", restarted_at))
            assert list(store.index.leases) == [after.lease_id]
            service.handle(protocol.Heartbeat(gen, time.time(), "second", restarted_at))
            assert list(store.index.leases) == [after.lease_id]     # the same incarnation: nothing more
            service.handle(protocol.ReleaseLease((after.lease_id,), gen))
            assert store.index.lease_count == 0
            running.cancel()

    try:
        asyncio.run(scenario())
    finally:
        store.close()


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_a_clip_over_the_token_budget_is_encoded_in_parts_equal_to_one_forward(tiny_dir, tmp_path, family):
    """Forwards of whole temporal patches under the budget, written into one
    entry: the same embedding (every DeepStack level too) as the clip's single
    forward."""
    from video_clips import write_clip

    from pipeline.media.video_cpu import plan_video_bytes
    from pipeline.models.loader import load_config
    from pipeline.processing.media_prompt import video_tokens_of
    from pipeline.processing.processor import video_config_of

    if family == "qwen3_vl":
        pytest.importorskip("transformers")
        import qwen3_vl_helpers

        folder = qwen3_vl_helpers.write_serving_checkpoint(tmp_path / "q3")
    else:
        folder = tiny_dir
    tower = load_model(folder, dtype="float32", device="cpu", part="visual").model
    loaded, model_config = load_config(folder)
    video_config = video_config_of(folder, video_tokens_of(loaded.spec(model_config)))
    config = ImageProcessorConfig.from_checkpoint(folder)
    clip = write_clip(24, 4, 64, 48, seed=11).data
    plan = plan_video_bytes(clip, video_config)[1]
    grid_t, tokens = plan.grid[0], plan.num_tokens
    assert grid_t >= 4
    embeddings = {}

    async def encode(budget: int, store: ArenaStore):
        sent: list = []
        with ThreadPoolExecutor(1) as decode_pool, ThreadPoolExecutor(1) as compute_pool:
            service = EncoderService(EncoderSettings("enc", "inproc://enc", "tiny", max_batch_tokens=budget), store,
                                     tower, create_backend("pillow", torch.device("cpu")), config,
                                     lambda address, message: sent.append(message) or True, decode_pool,
                                     compute_pool, video_config=video_config)
            running = asyncio.ensure_future(service.run())
            job = protocol.EncodeJob("v", "v", "", clip, "inproc://gen", 0, "inproc://proxy", modality="video")
            salt = service._salt(job)
            service.handle(msgspec_replace(job, content_hash=content_hash(clip, salt), expected_tokens=tokens))
            for _ in range(3000):
                if sent:
                    break
                await asyncio.sleep(0.01)
            ready, = sent
            assert isinstance(ready, protocol.EmbeddingReady), ready
            entry = store.index.get(ready.content_hash)
            start = entry.start_block * store.index.block_bytes
            embeddings[budget] = store.data[start:start + entry.nbytes].clone()
            forwards = service.vision.forwards
            service.handle(protocol.ReleaseLease((ready.lease_id,), "inproc://gen"))
            assert store.index.lease_count == 0
            running.cancel()
            return forwards

    two_steps = 2 * tokens // grid_t   # a budget of two temporal patches a forward
    for budget, expected_forwards in ((16384, 1), (two_steps, (grid_t + 1) // 2)):
        store = ArenaStore(4 << 20, 64 << 10, torch.device("cpu"), f"test-encsvc-parts-{budget}")
        try:
            assert asyncio.run(encode(budget, store)) == expected_forwards
        finally:
            store.close()
    assert torch.equal(embeddings[two_steps], embeddings[16384])


def test_an_abort_drops_the_jobs_not_begun_and_keeps_media_another_request_waits_for(tiny_dir):
    tower = load_model(tiny_dir, dtype="float32", device="cpu", part="visual").model
    config = ImageProcessorConfig.from_checkpoint(tiny_dir)
    store = ArenaStore(4 << 20, 64 << 10, torch.device("cpu"), "test-encsvc-abort")
    sent: list = []

    async def scenario():
        with ThreadPoolExecutor(1) as decode_pool, ThreadPoolExecutor(1) as compute_pool:
            service = pillow_service(store, tower, config, sent, decode_pool, compute_pool)
            alone, shared = (image_bytes(random_image(56, 56, seed=s)) for s in (4, 5))
            tokens = tower.tokens_per_image(service.media.decode([alone], config)[0].grid)

            def job(job_id, request_id, media):
                return protocol.EncodeJob(job_id, request_id, content_hash(media, service.salt), media,
                                          "inproc://gen", tokens, "inproc://proxy")

            # Queued before the loops run: nothing has begun.
            for message in (job("a/0", "a", alone), job("a/1", "a", shared), job("b/0", "b", shared)):
                service.handle(message)
            service.handle(protocol.AbortRequest(("a",)))
            assert [key for key, _ in service.to_decode] == [content_hash(shared, service.salt)]
            assert service.counters["dropped_media"] == 1 and len(service.flight) == 1
            running = asyncio.ensure_future(service.run())
            for _ in range(600):
                if any(isinstance(m, protocol.EmbeddingReady) for m in sent):
                    break
                await asyncio.sleep(0.01)
            answered = [(type(m).__name__, m.job_id) for m in sent if hasattr(m, "job_id")]
            assert answered == [("EmbeddingReady", "b/0")] and len(service.flight) == 0
            running.cancel()

    try:
        asyncio.run(scenario())
    finally:
        store.close()
