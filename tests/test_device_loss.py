"""A stage whose GPU context is lost ends, to be restarted, instead of
failing every later request (pipeline/device_loss.py). The CPU has no
context to lose: the round trip is made to fail as a dead MPS server makes
it fail, and the stages' reactions are checked."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from pipeline import device_loss, protocol
from pipeline.device_loss import DeviceLost, lost, raise_if_lost

CUDA = torch.device("cuda:0")
MPS_ERROR = "CUDA error: the remote procedural call between the MPS server and the MPS client failed"


@pytest.fixture
def dead_gpu(monkeypatch):
    def fails(device):
        raise RuntimeError(MPS_ERROR)

    monkeypatch.setattr(device_loss, "round_trip", fails)


def test_the_cpu_is_never_lost_and_a_gpu_is_lost_only_when_its_round_trip_fails(monkeypatch, caplog):
    assert not lost(torch.device("cpu"))
    monkeypatch.setattr(device_loss, "round_trip", lambda device: None)
    assert not lost(CUDA)
    raise_if_lost(CUDA, RuntimeError("one bad batch"))   # the GPU still answers: the stage goes on
    monkeypatch.setattr(device_loss, "round_trip", lambda device: (_ for _ in ()).throw(RuntimeError(MPS_ERROR)))
    assert lost(CUDA) and "no longer works" in caplog.text
    with pytest.raises(DeviceLost, match="cuda:0 was lost \\(first line\\); exiting to be restarted") as raised:
        raise_if_lost(CUDA, RuntimeError("first line\nsecond line"))
    assert isinstance(raised.value.__cause__, RuntimeError)


def test_an_encoder_whose_forward_fails_on_a_lost_gpu_ends_leaving_the_batch_to_its_replacement(tiny_dir, dead_gpu):
    from conftest import image_bytes, random_image
    from pipeline.arena.store import ArenaStore
    from pipeline.encoder.service import EncoderService, EncoderSettings
    from pipeline.hashing import content_hash
    from pipeline.media.registry import create_backend
    from pipeline.models.loader import load_model
    from pipeline.processing.image import ImageProcessorConfig

    tower = load_model(tiny_dir, dtype="float32", device="cpu", part="visual").model
    config = ImageProcessorConfig.from_checkpoint(tiny_dir)
    store = ArenaStore(4 << 20, 64 << 10, torch.device("cpu"), "test-device-loss")
    sent: list = []

    async def scenario():
        with ThreadPoolExecutor(1) as decode_pool, ThreadPoolExecutor(1) as compute_pool:
            def forward(pixels, grids):
                raise RuntimeError(MPS_ERROR)

            service = EncoderService(EncoderSettings("enc", "inproc://enc", "tiny"), store, tower,
                                     create_backend("pillow", torch.device("cpu")), config,
                                     lambda address, message: sent.append(message) or True, decode_pool,
                                     compute_pool, forward)
            service.device = CUDA   # where its tower would run on a GPU box
            media = image_bytes(random_image(56, 56, seed=5))
            (decoded,) = service.media.decode([media], config)
            service.handle(protocol.EncodeJob("j", "r", content_hash(media, service.salt), media, "inproc://gen",
                                              tower.tokens_per_image(decoded.grid), "inproc://proxy"))
            with pytest.raises(DeviceLost):
                await asyncio.wait_for(service.run(), timeout=60)

    try:
        asyncio.run(scenario())
    finally:
        store.close()
    # Unanswered: the proxy sends the job to the replacement (test_dispatcher_encoder_loss.py);
    # an answer would have failed its request, on a box with no other encoder to try.
    assert not [m for m in sent if isinstance(m, protocol.EncodeFailed)]
    assert store.index.lease_count == 0 and not store.index.entries


class FakeGenerator:
    def __init__(self) -> None:
        self.device = CUDA
        self.generated: list = []

    def on_generate(self, request, inputs, error, error_status) -> None:
        self.generated.append((error, error_status))


def test_a_generators_decoder_failure_on_a_lost_gpu_ends_the_engine_thread(monkeypatch):
    from pipeline.generator.dispatch import dispatch, handler_table
    from pipeline.generator.internal import PreparedRequest

    service = FakeGenerator()
    table = handler_table(service)
    request = protocol.GenerateRequest("r", (1, 2), (), (), (), protocol.Sampling(max_tokens=1), "inproc://proxy")
    bad_media = PreparedRequest(request, None, "bad image: truncated")
    failed_decoder = PreparedRequest(request, None, f"media decoding failed: {MPS_ERROR}", backend_failed=True)
    monkeypatch.setattr(device_loss, "round_trip", lambda device: None)
    dispatch(table, bad_media)
    dispatch(table, failed_decoder)   # the GPU still answers: the request fails alone
    # A bad image is the client's (400); a decoder that failed on a working GPU is the server's (500).
    assert service.generated == [(bad_media.error, 400), (failed_decoder.error, 500)]
    monkeypatch.setattr(device_loss, "round_trip", lambda device: (_ for _ in ()).throw(RuntimeError(MPS_ERROR)))
    dispatch(table, bad_media)   # a bad image says nothing of the GPU: not asked
    with pytest.raises(DeviceLost):
        dispatch(table, failed_decoder)
    assert len(service.generated) == 3
