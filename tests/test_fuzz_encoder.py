"""Property-based test of what the encoder does with whatever its inbox
decodes: EncoderService.handle, in-process on the tiny model's vision tower
and a real shared-memory arena, fed every message type with arbitrary
fields, frames mutated on the way, and encode jobs whose content hash is
right (so their media, valid or mutated images, is decoded and encoded).

The encoder must keep serving: handle never raises, its loops never stop,
every job and fetch gets exactly one answer (EmbeddingReady or
EncodeFailed), and once the leases announced are given back none is left.
"""

from __future__ import annotations

import asyncio
import itertools
from concurrent.futures import ThreadPoolExecutor

import torch
from hypothesis import given
from hypothesis import strategies as st

from conftest import image_bytes, random_image
from fuzz_helpers import fuzz, mutated
from message_strategies import CAUGHT, frames
from pipeline import protocol
from pipeline.arena.store import ArenaStore
from pipeline.encoder.service import EncoderService, EncoderSettings
from pipeline.hashing import content_hash
from pipeline.media.registry import create_backend
from pipeline.models.loader import load_model
from pipeline.processing.image import ImageProcessorConfig

WAIT_S = 20.0
IMAGES = [image_bytes(random_image(56, 56, seed=1)), image_bytes(random_image(40, 72, seed=2), "JPEG"),
          image_bytes(random_image(30, 30, seed=3, mode="RGBA"))]


def test_the_encoder_keeps_serving_whatever_it_is_sent(tiny_dir):
    tower = load_model(tiny_dir, dtype="float32", device="cpu", part="visual").model
    config = ImageProcessorConfig.from_checkpoint(tiny_dir)
    store = ArenaStore(4 << 20, 64 << 10, torch.device("cpu"), "fuzz-enc")
    media = create_backend("pillow", torch.device("cpu"))
    sent: list[tuple[str, protocol.Message]] = []
    ids = itertools.count()

    def send(address, message):
        sent.append((address, message))
        return True

    def answers(job_ids):
        return [m for _, m in sent if isinstance(m, (protocol.EmbeddingReady, protocol.EncodeFailed))
                and m.job_id in job_ids]

    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    with ThreadPoolExecutor(1) as decode_pool, ThreadPoolExecutor(1) as compute_pool:
        service = EncoderService(EncoderSettings("enc", "inproc://enc", "tiny"), store, tower, media, config,
                                 send, decode_pool, compute_pool)
        tokens = {data: tower.tokens_per_image(decoded.grid)
                  for data, decoded in zip(IMAGES, media.decode(IMAGES, config))}

        @st.composite
        def hashed_jobs(draw) -> protocol.EncodeJob:
            """A job for media whose hash is right, so it is decoded: a valid
            image (the right token count, or not) or a mutated one."""
            data = draw(st.sampled_from(IMAGES))
            if draw(st.booleans()):
                data = draw(mutated(data))
            expected = tokens.get(data, 1) if draw(st.booleans()) else draw(st.integers(-2**63, 2**63 - 1))
            return protocol.EncodeJob(f"\u2603job-{next(ids)}", "req", content_hash(data, service.salt), data,
                                      "inproc://gen", expected, "inproc://proxy")

        @fuzz(40)
        @given(batch=st.lists(frames.map(lambda f: ("frame", f)) | hashed_jobs().map(lambda j: ("job", j)),
                              max_size=6))
        def check(batch):
            sent.clear()
            jobs = []
            for kind, item in batch:
                if kind == "job":
                    jobs.append(item.job_id)
                    service.handle(item)
                    continue
                try:
                    message = protocol.decode(item)
                except CAUGHT:
                    continue   # the inbox drops it (test_fuzz_messages.py)
                if isinstance(message, (protocol.EncodeJob, protocol.FetchEmbedding)):
                    jobs.append(message.job_id)
                service.handle(message)

            async def until_answered():
                while len(answers(set(jobs))) < len(jobs):
                    assert not running.done(), running
                    await asyncio.sleep(0.005)

            loop.run_until_complete(asyncio.wait_for(until_answered(), WAIT_S))
            assert not running.done()
            got = answers(set(jobs))
            assert sorted(m.job_id for m in got) == sorted(jobs)   # one answer each, however mangled
            # Every lease taken was announced: giving back those announced leaves none.
            leases = tuple(m.lease_id for _, m in sent if isinstance(m, protocol.EmbeddingReady))
            service.handle(protocol.ReleaseLease(leases, "inproc://gen"))
            assert store.index.lease_count == 0

        running = loop.create_task(service.run())
        try:
            check()
            assert len(service.flight) == 0 and not running.done()
        finally:
            running.cancel()
            loop.run_until_complete(asyncio.gather(running, return_exceptions=True))
            asyncio.set_event_loop(None)
            loop.close()
            media.close()
            store.close()
