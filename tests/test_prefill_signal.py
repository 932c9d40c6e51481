"""Encoder forwards held while a generator beside them prefills
(pipeline/prefill_signal.py): the shared byte, the encoder's bounded hold,
the engine's signal around its prefill steps, and the launcher's plan."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from conftest import image_bytes, random_image
from e2e_helpers import chat
from stack import Stack
from waiting import until
from pipeline import protocol
from pipeline.arena.store import ArenaStore
from pipeline.encoder.service import EncoderService, EncoderSettings
from pipeline.engine.engine import Engine, EngineConfig
from pipeline.hashing import content_hash
from pipeline.launch.plan import HostFacts, LaunchError, LaunchOptions, plan_stages
from pipeline.media.registry import create_backend
from pipeline.models.loader import load_model
from pipeline.prefill_signal import POLL_S, PrefillHold, PrefillSignal, signalling
from pipeline.processing.image import ImageProcessorConfig
from pipeline.processing.processor import Processor
from pipeline.sampling_params import SamplingParams


def test_the_byte_is_shared_by_every_mapping_of_the_file_and_a_late_opener_keeps_it(tmp_path):
    path = tmp_path / "generator-0.prefill"
    writer = PrefillSignal(path)
    assert path.stat().st_size == 1 and not writer.is_set()
    writer.set(True)
    reader = PrefillSignal(path)   # opened after the byte was set: must not clear it
    assert reader.is_set()
    writer.set(False)
    assert not reader.is_set()
    writer.close()
    reader.close()


class FakeTime:
    """A clock that moves only when the hold sleeps; `on_sleep` runs on each sleep."""

    def __init__(self, on_sleep=lambda sleeps: None) -> None:
        self.now = 100.0
        self.sleeps = 0
        self.on_sleep = on_sleep

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.sleeps += 1
        self.on_sleep(self.sleeps)


def test_a_hold_waits_while_the_byte_is_set_and_never_past_its_bound(tmp_path):
    signal = PrefillSignal(tmp_path / "g.prefill")
    idle = FakeTime()
    assert PrefillHold([signal], 0.03, idle.clock, idle.sleep).wait() == 0.0 and idle.sleeps == 0
    signal.set(True)
    clears = FakeTime(lambda sleeps: sleeps == 3 and signal.set(False))
    assert PrefillHold([signal], 0.03, clears.clock, clears.sleep).wait() == pytest.approx(3 * POLL_S)
    signal.set(True)
    stuck = FakeTime()
    held = PrefillHold([signal], 0.03, stuck.clock, stuck.sleep).wait()
    assert 0.03 <= held < 0.03 + 2 * POLL_S   # a generator that prefills without end still lets forwards through
    with pytest.raises(ValueError, match="> 0"):
        PrefillHold([signal], 0.0)
    signal.close()


def test_a_hold_waits_on_any_generator_of_its_gpu(tmp_path):
    first, second = PrefillSignal(tmp_path / "a"), PrefillSignal(tmp_path / "b")
    second.set(True)
    fake = FakeTime(lambda sleeps: sleeps == 2 and second.set(False))
    assert PrefillHold([first, second], 1.0, fake.clock, fake.sleep).wait() == pytest.approx(2 * POLL_S)


def test_a_restarted_generator_clears_the_byte_its_dead_predecessor_left_set(tmp_path):
    path = tmp_path / "generator-0.prefill"
    encoder_side = PrefillSignal(path)
    PrefillSignal(path, writer=True).set(True)   # a generator dies in a prefill step
    assert encoder_side.is_set()
    PrefillSignal(path, writer=True)   # its restart is not prefilling
    assert not encoder_side.is_set()
    PrefillSignal(path, writer=True).set(True)
    assert PrefillSignal(path).is_set() and encoder_side.is_set()   # a reader's open leaves the byte as it was


def test_signalling_clears_the_byte_however_the_block_ends(tmp_path):
    signal = PrefillSignal(tmp_path / "g")
    with pytest.raises(RuntimeError):
        with signalling(signal.set):
            assert signal.is_set()
            raise RuntimeError("a failed step")
    assert not signal.is_set()
    with signalling(None):   # no signal asked for: nothing to call
        pass


def test_the_engine_signals_exactly_its_steps_with_prefill_tokens(tiny_dir):
    """Set before the step's forward is launched, cleared once its tokens are
    chosen; decode-only steps leave it alone."""
    loaded = load_model(tiny_dir)
    processor = Processor.from_checkpoint(tiny_dir, loaded.config.image_token_id)
    engine = Engine(loaded.model, processor.tokenizer,
                    EngineConfig(max_num_batched_tokens=16, kv_cache_bytes=8 << 20), torch.device("cpu"))
    calls: list[bool] = []
    engine.on_prefill = calls.append
    during_forward: list[bool] = []
    execute = engine.runner.execute
    engine.runner.execute = lambda *a, **k: during_forward.append(bool(calls) and calls[-1]) or execute(*a, **k)
    prompt = processor.chat_prompt([{"role": "user", "content": [{"type": "text", "text": "a red " * 12}]}], [])
    prefill_steps = -(-len(prompt.token_ids) // 16)
    assert prefill_steps >= 2, "the test wants a prompt in several chunks"
    engine.add_request("r", prompt, [], SamplingParams(max_tokens=6, ignore_eos=True))
    tokens = []
    for _ in range(50):
        tokens += [t for out in engine.step() for t in out.new_token_ids]
        if not engine.has_work():
            break
    assert len(tokens) == 6
    assert calls == [True, False] * prefill_steps
    # Every prefill step's forward ran with the byte set; the 5 decode steps' without.
    assert during_forward == [True] * prefill_steps + [False] * 5


def test_an_encoder_with_a_hold_runs_one_image_a_forward_and_counts_the_held_time(tiny_dir, tmp_path):
    tower = load_model(tiny_dir, dtype="float32", device="cpu", part="visual").model
    config = ImageProcessorConfig.from_checkpoint(tiny_dir)
    store = ArenaStore(4 << 20, 64 << 10, torch.device("cpu"), "test-prefill-hold")
    signal = PrefillSignal(tmp_path / "generator-0.prefill")
    signal.set(True)   # a generator that prefills throughout: every forward waits out the bound
    sent: list[protocol.Message] = []

    async def scenario():
        with ThreadPoolExecutor(1) as decode_pool, ThreadPoolExecutor(1) as compute_pool:
            service = EncoderService(EncoderSettings("enc", "inproc://enc", "tiny"), store, tower,
                                     create_backend("pillow", torch.device("cpu")), config,
                                     lambda address, message: sent.append(message) or True, decode_pool,
                                     compute_pool, prefill_hold=PrefillHold([signal], 0.05))
            running = asyncio.ensure_future(service.run())
            images = [image_bytes(random_image(56, 56, seed=40 + i)) for i in range(3)]
            for i, media in enumerate(images):
                (decoded,) = service.media.decode([media], config)
                service.handle(protocol.EncodeJob(f"j{i}", f"r{i}", content_hash(media, service.salt), media,
                                                  "inproc://gen", tower.tokens_per_image(decoded.grid),
                                                  "inproc://proxy"))
            for _ in range(1000):
                if sum(isinstance(m, protocol.EmbeddingReady) for m in sent) == 3:
                    break
                await asyncio.sleep(0.01)
            assert sum(isinstance(m, protocol.EmbeddingReady) for m in sent) == 3, sent
            stats = service.stats()
            assert stats.counters["forwards"] == 3   # one image a forward, however many were queued
            assert stats.counters["busy_us.held"] >= 3 * 50_000
            running.cancel()

    try:
        asyncio.run(scenario())
    finally:
        store.close()
        signal.close()


# ---- the launcher's plan -----------------------------------------------------

RUN = Path("/tmp/epd-test-run")


def plan(**overrides):
    base = dict(encoders=1, generators=2, run_dir=RUN, model=Path("/models/m"), python="python",
                device="cuda", encoder_yield_ms=25.0)
    specs = plan_stages(LaunchOptions(**{**base, **overrides}), HostFacts(gpu_count=2))
    return {s.instance: (s.device, s.args) for s in specs}


def values(args, flag):
    return [args[i + 1] for i, a in enumerate(args) if a == flag]


def test_the_plan_pairs_each_encoder_with_the_generators_on_its_gpu():
    stages = plan(placement="colocated")
    encoder_device, encoder_args = stages["encoder-0"]
    beside = [name for name, (device, _) in stages.items() if name.startswith("generator") and device == encoder_device]
    assert len(beside) == 1
    assert values(encoder_args, "--yield-to-prefill") == [str(RUN / f"{beside[0]}.prefill")]
    assert values(encoder_args, "--yield-max-ms") == ["25"]
    assert values(stages[beside[0]][1], "--prefill-signal") == [str(RUN / f"{beside[0]}.prefill")]
    alone = next(name for name in stages if name.startswith("generator") and name != beside[0])
    assert "--prefill-signal" not in stages[alone][1]   # no encoder beside it: nothing to tell


def test_no_signal_where_no_encoder_shares_a_gpu_or_without_the_option():
    for stages in (plan(placement="dedicated", generators=1), plan(device="cpu"), plan(encoder_yield_ms=None)):
        for _, args in stages.values():
            assert not {"--yield-to-prefill", "--prefill-signal", "--yield-max-ms"} & set(args)


def test_the_option_is_checked_and_its_flags_are_the_launchers_own():
    with pytest.raises(LaunchError, match="--encoder-yield-ms must be > 0"):
        plan(encoder_yield_ms=0.0)
    with pytest.raises(LaunchError, match="set by the launcher"):
        plan(stage_args=(("encoder", "--yield-to-prefill=/tmp/x"),))
    with pytest.raises(LaunchError, match="set by the launcher"):
        plan(stage_args=(("generator", "--prefill-signal=/tmp/x"),))


# ---- real processes ------------------------------------------------------------

def test_a_stack_with_the_signal_serves_every_request_and_leaves_the_byte_clear(tmp_path, tiny_dir):
    """The stage flags as epd-launch --encoder-yield-ms passes them, on the
    tiny model: concurrent image requests all complete, each image through
    the tower once, the held time on /metrics, and once the generator is idle
    no prefill is signalled."""
    path = tmp_path / "generator-0.prefill"
    stack = Stack(tmp_path, tiny_dir, encoders=1, generators=1, generator_args=("--prefill-signal", str(path)),
                  encoder_args=("--yield-to-prefill", str(path), "--yield-max-ms", "20"))
    try:
        stack.wait_healthy()
        assert stack.wait_for_log("held up to 20 ms while a generator beside this encoder prefills")
        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(chat, stack, [image_bytes(random_image(64, 48 + 8 * i, seed=700 + i))],
                                   f"image {i}", max_tokens=5, ignore_eos=True) for i in range(6)]
            assert [f.result(timeout=120)[2].completion_tokens for f in futures] == [5] * 6
        until(lambda: stack.total("epd_encoder_images_total", phase="forward") >= 6,   # stats are polled
              "the encoder's forwards to show on /metrics", 15)
        assert stack.total("epd_encoder_images_total", phase="forward") == 6
        assert any('phase="held"' in key for key in stack.metrics() if key.startswith("epd_encoder_busy_seconds_total"))
        assert not PrefillSignal(path).is_set()
    finally:
        stack.close()
