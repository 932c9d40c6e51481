"""A real encoder process and this test as its consumer, over ZeroMQ and the
shared-memory arena."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import zmq.asyncio

from conftest import REPO, image_bytes, random_image
from pipeline import protocol, transport
from pipeline.arena.reader import ArenaReader
from pipeline.arena.shm import our_segments, remove_stale_segments
from pipeline.hashing import content_hash, media_salt
from pipeline.models.loader import load_model
from pipeline.processing.image import ImageProcessorConfig, num_visual_tokens, open_image, preprocess_images


class Consumer:
    """What a generator does with an encoder, reduced to the protocol."""

    def __init__(self, run_dir, encoder_address, model_dir, model_id):
        self.ctx = zmq.asyncio.Context()
        self.address = f"ipc://{run_dir}/consumer.sock"
        self.inbox = transport.Inbox(self.ctx, self.address)
        self.outbox = transport.Outbox(self.ctx)
        self.encoder = encoder_address
        self.config = ImageProcessorConfig.from_checkpoint(model_dir)
        self.salt = media_salt(model_id, self.config.settings_key())
        self.reader = ArenaReader()
        self.jobs = 0

    async def recv(self, timeout=60.0):
        """The next message that is not a (repeated) announcement."""
        while True:
            message = await asyncio.wait_for(self.inbox.recv(), timeout)
            if not isinstance(message, protocol.EncoderAnnounce):
                return message

    async def connect(self):
        # The encoder may still be loading: say hello until it answers.
        for _ in range(600):
            self.outbox.send(self.encoder, protocol.Hello("test", self.address))
            try:
                announce = await asyncio.wait_for(self.inbox.recv(), 0.5)
                self.reader.open(announce.arena)
                return announce
            except asyncio.TimeoutError:
                continue
        raise TimeoutError("encoder never announced itself")

    def job(self, media: bytes, expected_tokens=None, content_hash_=None):
        self.jobs += 1
        if expected_tokens is None:
            im = open_image(media, self.config)
            expected_tokens = num_visual_tokens(im.height, im.width, self.config)
        return protocol.EncodeJob(f"job-{self.jobs}", f"req-{self.jobs}",
                                  content_hash_ or content_hash(media, self.salt), media,
                                  self.address, expected_tokens)

    async def stats(self):
        self.outbox.send(self.encoder, protocol.StatsRequest(self.address))
        while True:
            message = await self.recv()
            if isinstance(message, protocol.StageStats):
                return message

    def close(self):
        self.reader.close()
        self.inbox.close()
        self.outbox.close()
        self.ctx.term()


@pytest.fixture
def encoder_process(tiny_dir, tmp_path):
    address = f"ipc://{tmp_path}/encoder.sock"
    instance = f"test-enc-{os.getpid()}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "stages.encoder", "--address", address, "--model", str(tiny_dir),
         "--device", "cpu", "--instance", instance, "--media-backend", "pillow", "--arena-mib", "8",
         "--model-id", "tiny"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    yield address, instance, proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()
        remove_stale_segments(instance)  # what the next incarnation would do


def test_encoder_process_serves_embeddings_through_the_arena(encoder_process, tiny_dir, tmp_path):
    address, instance, proc = encoder_process
    tower = load_model(tiny_dir, part="visual").model
    images = {name: image_bytes(random_image(h, w, seed=s), fmt)
              for name, (h, w, s, fmt) in {"a": (120, 200, 1, "PNG"), "b": (300, 90, 2, "JPEG")}.items()}

    async def scenario():
        consumer = Consumer(tmp_path, address, tiny_dir, "tiny")
        try:
            announce = await consumer.connect()
            assert announce.widths == {"image": tower.out_dim}
            assert announce.arena.kind == "shm"

            # Two different images, then each embedding equals the tower's own output.
            for media in images.values():
                consumer.outbox.send(address, consumer.job(media))
            readies = [await consumer.recv() for _ in images]
            for ready, media in zip(sorted(readies, key=lambda r: r.job_id), images.values()):
                assert isinstance(ready, protocol.EmbeddingReady), ready
                got = consumer.reader.read(ready.handle)
                decoded = open_image(media, consumer.config)
                pixels, grid = preprocess_images([decoded], consumer.config)
                with torch.no_grad():
                    expected = tower(pixels, [tuple(grid[0].tolist())])[0]
                torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
                consumer.outbox.send(address, protocol.ReleaseLease((ready.lease_id,), consumer.address))

            # Ten concurrent jobs for one new image: one forward, ten handles.
            before = (await consumer.stats()).counters
            media = image_bytes(random_image(64, 64, seed=3))
            for _ in range(10):
                consumer.outbox.send(address, consumer.job(media))
            readies = [await consumer.recv() for _ in range(10)]
            assert [r.dedup for r in readies].count(False) == 1
            assert len({r.handle for r in readies}) == 1
            after = (await consumer.stats()).counters
            assert after["forwards"] - before["forwards"] == 1
            assert after["encoded"] - before["encoded"] == 1
            assert after["dedup"] - before.get("dedup", 0) == 9
            consumer.outbox.send(address, protocol.ReleaseLease(tuple(r.lease_id for r in readies),
                                                                consumer.address))

            # Bad media gets a failure with a reason; the next job is served.
            truncated = image_bytes(random_image(200, 200, seed=4), "JPEG")[:500]
            bad = {b"": "bad image", b"not an image": "bad image", truncated: "bad image"}
            for media, reason in bad.items():
                consumer.outbox.send(address, consumer.job(media, expected_tokens=1))
                failed = await consumer.recv()
                assert isinstance(failed, protocol.EncodeFailed) and reason in failed.reason
                assert not failed.retryable
            # A content hash that does not match the bytes never aliases another image.
            consumer.outbox.send(address, consumer.job(images["b"], content_hash_=content_hash(images["a"], consumer.salt)))
            failed = await consumer.recv()
            assert isinstance(failed, protocol.EncodeFailed) and "does not match" in failed.reason
            # A placeholder count that disagrees with the image is an error.
            consumer.outbox.send(address, consumer.job(images["a"], expected_tokens=3))
            failed = await consumer.recv()
            assert isinstance(failed, protocol.EncodeFailed) and "visual tokens" in failed.reason
            consumer.outbox.send(address, consumer.job(images["a"]))
            ready = await consumer.recv()
            assert isinstance(ready, protocol.EmbeddingReady) and ready.dedup
            consumer.outbox.send(address, protocol.ReleaseLease((ready.lease_id,), consumer.address))

            stats = await consumer.stats()
            assert stats.gauges["arena_leases"] == 0
            assert stats.gauges["in_flight"] == 0
        finally:
            consumer.close()

    transport.install_event_loop()
    asyncio.run(scenario())
    assert any(n.startswith(f"epd-{instance}-") for n in our_segments())
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0, proc.stdout.read()
    assert not [n for n in our_segments() if n.startswith(f"epd-{instance}-")]
