"""The generator's engine thread in-process: a fake engine with scripted
steps, fake messages, a real CPU arena for the embeddings' handles, and a
`send` that records. Each test drives the loop one turn at a time
(`run_once`, never blocking), so nothing waits on a clock."""

from __future__ import annotations

import logging
import queue
from types import SimpleNamespace

import pytest
import torch

from conftest import random_image
from pipeline import protocol
from pipeline.arena.store import ArenaStore
from pipeline.engine.engine import Engine, EngineConfig
from pipeline.engine.output import RequestOutput
from pipeline.sampling_params import SamplingParams
from pipeline.engine.step_profile import StepProfile
from pipeline.generator.internal import AskerRestarted
from pipeline.generator.refetch import FETCH_JOB
from pipeline.generator.service import GeneratorService
from pipeline.models.loader import load_model
from pipeline.processing.image import preprocess_images
from pipeline.processing.processor import Processor

WIDTH = 8
ENCODER = "ipc://enc"
PROXY = "ipc://proxy"


class FakeEngine:
    """The public methods GeneratorService uses of Engine: requests and
    embeddings are recorded, `step` returns what the test scripted."""

    def __init__(self, room_tokens: int = 1000) -> None:
        self.model = SimpleNamespace(spec=SimpleNamespace(embedding_width=WIDTH))
        self.profile = StepProfile()
        self.last_step_idle = False
        self.room_tokens = room_tokens
        self.requests: dict[str, list[str]] = {}      # request id -> its image keys
        self.embeddings: dict[str, torch.Tensor] = {}
        self.aborted: list[str] = []
        self.resumed: dict = {}                       # request id -> the engine.Resumed it came with
        self.salts: dict[str, str] = {}               # request id -> its cache_salt
        self.priorities: dict[str, int] = {}          # request id -> its priority
        self.script: list[list[RequestOutput]] = []   # what each step returns, in order
        self.refetch: list[str] = []                  # what the next take_refetches hands out
        self.steps = 0

    def add_request(self, request_id, prompt, image_keys, params, image_inputs=None, resumed=None,
                    cache_salt="", priority=0) -> None:
        if len(image_keys) != len(prompt.image_spans):
            raise ValueError(f"{len(image_keys)} image keys for {len(prompt.image_spans)} image spans")
        self.requests[request_id] = list(image_keys)
        self.resumed[request_id] = resumed
        self.salts[request_id] = cache_salt
        self.priorities[request_id] = priority

    def add_embedding(self, key, embedding) -> None:
        if embedding.shape[1] != WIDTH:
            raise ValueError(f"image embedding {key} is {embedding.shape[1]} wide")
        self.embeddings[key] = embedding

    def abort(self, request_id) -> bool:
        self.aborted.append(request_id)
        return self.requests.pop(request_id, None) is not None

    def has_work(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        self.steps += 1
        outputs = self.script.pop(0) if self.script else []
        for output in outputs:
            if output.finished:
                self.requests.pop(output.request_id, None)
        return outputs

    def holds_embedding(self, key) -> bool:
        return key in self.embeddings

    def has_room_for(self, tokens) -> bool:
        held = sum(e.shape[0] for e in self.embeddings.values())
        return not self.embeddings or held + tokens <= self.room_tokens

    def embedding_needed(self, key) -> bool:
        return any(key in keys for keys in self.requests.values())

    def embedding_users(self, key) -> frozenset[str]:
        return frozenset(rid for rid, keys in self.requests.items() if key in keys)

    def take_refetches(self) -> list[str]:
        keys, self.refetch = self.refetch, []
        return keys

    def request_image_tokens(self, request_id, key):
        return 4 if key in self.requests.get(request_id, ()) else None

    def load(self) -> dict[str, float]:
        return {"running": float(len(self.requests))}

    def counters(self) -> dict[str, int]:
        return {"steps": self.steps}


class Harness:
    def __init__(self, store: ArenaStore, engine: FakeEngine, embedding_timeout: float = 60.0) -> None:
        self.store, self.engine = store, engine
        self.sent: list[tuple[str, protocol.Message]] = []
        self.inbound: queue.SimpleQueue = queue.SimpleQueue()
        self.service = GeneratorService(engine, "ipc://gen", torch.device("cpu"), self._send, [ENCODER],
                                        embedding_timeout, heartbeat_interval=1e9)

    def _send(self, address, message) -> bool:
        self.sent.append((address, message))
        return True

    def turn(self, *messages) -> list[tuple[str, protocol.Message]]:
        """Queue `messages`, run one turn, return what it sent (heartbeats aside)."""
        self.sent.clear()
        for message in messages:
            self.inbound.put(message)
        self.service.run_once(self.inbound, may_block=False)
        return [(a, m) for a, m in self.sent if not isinstance(m, protocol.Heartbeat)]

    def announce(self) -> protocol.EncoderAnnounce:
        return protocol.EncoderAnnounce("enc-0", ENCODER, "tiny", self.store.info, {"image": WIDTH})

    def ready(self, request_id: str, key: str, rows: int = 4, width: int = WIDTH,
              job_id: str = "") -> protocol.EmbeddingReady:
        entry = self.store.reserve(key, (rows, width), torch.float32)
        self.store.write(entry, torch.full((rows, width), float(len(key))))
        return protocol.EmbeddingReady(job_id or f"{request_id}/0", request_id, key, self.store.handle(entry),
                                       f"lease-{request_id}-{key}", "enc-0")


def generate(request_id: str, keys: tuple[str, ...] = (), spans: int | None = None) -> protocol.GenerateRequest:
    count = len(keys) if spans is None else spans
    return protocol.GenerateRequest(request_id, tuple(range(1, 6 + 4 * count)),
                                    tuple((1 + 4 * i, 4) for i in range(count)), keys,
                                    tuple((1, 4, 4) for _ in range(count)), protocol.Sampling(4), PROXY)


def output(request_id: str, token: int, finished: bool = False) -> RequestOutput:
    return RequestOutput(request_id, (token,), f"t{token}", finished, "stop" if finished else None, 5, 1)


def released(sent) -> list[str]:
    return [lease for _, m in sent if isinstance(m, protocol.ReleaseLease) for lease in m.lease_ids]


def deltas(sent) -> list[tuple[str, str, tuple, bool, int]]:
    return [(a, m.request_id, m.token_ids, m.finished, m.status) for a, m in sent
            if isinstance(m, protocol.TokenDelta)]


@pytest.fixture
def store():
    arena = ArenaStore(1 << 20, 4096, torch.device("cpu"), "test-gensvc")
    yield arena
    arena.close()


@pytest.fixture
def harness(store):
    made = Harness(store, FakeEngine())
    yield made
    made.service.close()


def test_a_request_streams_its_deltas_and_is_forgotten_when_it_finishes(harness):
    engine = harness.engine
    engine.script = [[output("r1", 7)], [output("r1", 8, finished=True)]]
    assert deltas(harness.turn(generate("r1"))) == [(PROXY, "r1", (7,), False, 0)]
    assert "r1" in harness.service.requests and engine.requests == {"r1": []}
    assert deltas(harness.turn()) == [(PROXY, "r1", (8,), True, 0)]
    assert "r1" not in harness.service.requests and harness.service.requests.gone("r1")
    assert harness.turn() == [] and engine.steps == 2       # nothing left to step
    assert harness.service.counters["requests"] == 1 and harness.service.counters["errors"] == 0


def test_a_request_the_engine_refuses_is_answered_with_a_400_and_not_tracked(harness):
    sent = harness.turn(generate("bad", ("k",), spans=0))
    ((address, delta),) = sent
    assert address == PROXY and delta.finish_reason == "error" and delta.status == 400
    assert "image keys" in delta.error and "bad" not in harness.service.requests
    assert harness.service.counters["errors"] == 1
    # Its image comes later: given back unread, not copied and held for it.
    harness.turn(harness.announce())
    assert released(harness.turn(harness.ready("bad", "k"))) == ["lease-bad-k"]
    assert harness.service.counters["embeddings"] == 0 and len(harness.service.early) == 0


def test_an_embedding_is_copied_out_of_the_arena_and_its_lease_given_back(harness, store):
    assert harness.turn(harness.announce()) == []
    ready = harness.ready("r1", "k")
    harness.turn(generate("r1", ("k",)))
    assert harness.service.requests.get("r1").missing == {"k"}
    sent = harness.turn(ready)
    assert released(sent) == [ready.lease_id]      # a CPU copy is done at once: released the same turn
    assert [(a, type(m)) for a, m in sent] == [(ENCODER, protocol.ReleaseLease)]
    assert torch.equal(harness.engine.embeddings["k"], torch.full((4, WIDTH), 1.0))
    assert harness.service.requests.get("r1").missing == set()
    assert harness.service.key_sources.address_of("k") == ENCODER and harness.service.counters["embeddings"] == 1
    store.index.release(ready.lease_id)        # what the encoder does on ReleaseLease
    assert store.index.lease_count == 0


def test_an_embedding_that_overtakes_its_request_is_kept_for_it(harness):
    harness.turn(harness.announce())
    ready = harness.ready("r1", "k")
    assert released(harness.turn(ready)) == [ready.lease_id]
    assert len(harness.service.early) == 1
    harness.engine.embeddings.clear()      # the engine let go of it meanwhile (no request needed it)
    harness.turn(generate("r1", ("k",)))
    assert "k" in harness.engine.embeddings and len(harness.service.early) == 0
    assert harness.service.requests.get("r1").missing == set()


def test_a_handle_before_its_arena_is_announced_waits_and_asks_for_the_announcement(harness):
    ready = harness.ready("r1", "k")
    harness.turn(generate("r1", ("k",)))
    sent = harness.turn(ready)
    assert [(a, type(m)) for a, m in sent] == [(ENCODER, protocol.Hello)]
    assert len(harness.service.waiting_for_arena) == 1 and "k" not in harness.engine.embeddings
    sent = harness.turn(harness.announce())
    assert released(sent) == [ready.lease_id] and "k" in harness.engine.embeddings
    assert len(harness.service.waiting_for_arena) == 0


def test_an_embedding_for_a_request_that_ended_is_given_back_unread(harness):
    harness.turn(harness.announce())
    harness.engine.script = [[output("r1", 7, finished=True)]]
    harness.turn(generate("r1", ("k",)))
    sent = harness.turn(harness.ready("r1", "k"))
    assert released(sent) == ["lease-r1-k"] and "k" not in harness.engine.embeddings
    assert harness.service.counters["embeddings"] == 0


def test_an_embedding_past_the_room_is_parked_then_read_when_room_is_made(store):
    harness = Harness(store, FakeEngine(room_tokens=6))
    try:
        harness.turn(harness.announce())
        harness.turn(generate("r1", ("a", "b")))
        first, second = harness.ready("r1", "a"), harness.ready("r1", "b")
        assert released(harness.turn(first)) == [first.lease_id]
        assert released(harness.turn(second)) == []          # 4 + 4 rows > 6: left in the arena, leased
        assert len(harness.service.parking) == 1 and harness.service.counters["parked"] == 1
        assert harness.service.requests.get("r1").missing == set()   # it came: no timeout while parked
        del harness.engine.embeddings["a"]                   # the cache let one go
        assert released(harness.turn()) == []                # read this turn, after the copies were checked
        assert "b" in harness.engine.embeddings and len(harness.service.parking) == 0
        assert released(harness.turn()) == [second.lease_id]   # its copy is released the next turn
    finally:
        harness.service.close()


def test_a_request_whose_image_does_not_come_in_time_fails_with_a_504(harness):
    harness.turn(generate("r1", ("k",)))
    harness.service.requests.get("r1").deadline -= 120.0      # its deadline passed
    ((address, delta),) = harness.turn()
    assert address == PROXY and delta.status == 504 and "did not arrive within 60 s" in delta.error
    assert harness.engine.aborted == ["r1"] and harness.service.requests.gone("r1")


def test_an_abort_before_its_request_drops_the_request_when_it_comes(harness):
    assert harness.turn(protocol.AbortRequest(("r1",))) == []
    assert harness.turn(generate("r1")) == [] and harness.engine.requests == {}
    assert harness.service.counters["requests"] == 0
    harness.turn(harness.announce())     # an image of the dropped request, late: given back unread
    assert released(harness.turn(harness.ready("r1", "k"))) == ["lease-r1-k"]
    assert harness.service.counters["embeddings"] == 0 and len(harness.service.early) == 0
    harness.engine.script = [[output("r2", 7)]]
    harness.turn(generate("r2"))
    harness.turn(protocol.AbortRequest(("r2",)))
    assert harness.engine.aborted == ["r1", "r2"] and "r2" not in harness.service.requests
    harness.engine.requests["r2"] = []          # an engine that still steps it once: nothing is sent
    harness.engine.script = [[output("r2", 8)]]
    assert deltas(harness.turn()) == []


def test_a_failed_encode_fails_its_requests_or_asks_the_proxy_again(harness):
    harness.turn(generate("r1", ("bad",)), generate("r2", ("lost",)))
    sent = harness.turn(protocol.EncodeFailed("j", "r1", "bad", "not an image", False, "enc-0"))
    assert deltas(sent) == [(PROXY, "r1", (), True, 400)] and "r1" not in harness.service.requests
    sent = harness.turn(protocol.EncodeFailed("j", "r2", "lost", "arena full", True, "enc-0"))
    ((address, wanted),) = sent
    assert address == PROXY and isinstance(wanted, protocol.EmbeddingWanted)
    assert (wanted.request_id, wanted.content_hashes) == ("r2", ("lost",)) and "r2" in harness.service.requests


def test_an_embedding_of_the_wrong_width_fails_the_requests_that_use_it(harness):
    harness.turn(harness.announce())
    harness.turn(generate("r1", ("k",)), generate("r2", ("k",)), generate("r3"))
    sent = harness.turn(harness.ready("r1", "k", width=WIDTH + 1))
    assert sorted(r for _, r, _, _, status in deltas(sent) if status == 400) == ["r1", "r2"]
    assert "r3" in harness.service.requests and released(sent) == ["lease-r1-k"]


def test_an_evicted_embedding_is_fetched_again_from_the_encoder_that_delivered_it(harness):
    harness.turn(harness.announce())
    harness.turn(generate("r1", ("k",)))
    harness.turn(harness.ready("r1", "k"))
    harness.engine.refetch = ["k"]          # the step evicts it
    sent = harness.turn()
    fetches = [(a, m) for a, m in sent if isinstance(m, protocol.FetchEmbedding)]
    ((address, fetch),) = fetches
    assert address == ENCODER and fetch.job_id == f"{FETCH_JOB}k" and fetch.expected_tokens == 4
    assert "k" in harness.service.refetches


def test_a_restarted_proxy_s_requests_are_dropped(harness):
    harness.turn(generate("r1"), generate("r2"))
    assert harness.turn(AskerRestarted(PROXY)) == []
    assert sorted(harness.engine.aborted) == ["r1", "r2"] and len(harness.service.requests) == 0


def test_stats_report_the_engine_s_load_and_the_service_s_queues(harness):
    harness.turn(generate("r1"), generate("r2", ("k",), spans=0))
    stats = harness.service.stats()
    assert stats.stage == "generator" and stats.address == "ipc://gen"
    assert stats.gauges["running"] == 1.0 and stats.gauges["parked_embeddings"] == 0.0
    assert stats.counters["requests"] == 2 and stats.counters["errors"] == 1 and stats.counters["steps"] == 1


def test_an_unexpected_message_is_logged_and_ignored(harness, caplog):
    with caplog.at_level(logging.WARNING, logger="epd.generator"):
        assert harness.turn(protocol.StatsRequest(PROXY)) == []
    assert "ignoring unexpected StatsRequest" in caplog.text


def test_the_fake_engine_has_only_what_the_real_one_offers():
    methods = [name for name in vars(FakeEngine) if not name.startswith("_")]
    assert len(methods) > 10 and [name for name in methods if not callable(getattr(Engine, name, None))] == []


def test_the_real_engine_answers_the_generator_s_questions(tiny_dir):
    loaded = load_model(tiny_dir)
    processor = Processor.from_checkpoint(tiny_dir, loaded.config.image_token_id)
    image = random_image(60, 90, seed=1)
    prompt = processor.chat_prompt([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}],
                                   [(image.height, image.width)])
    pixels, grid = preprocess_images([image], processor.image_config)
    embedding = loaded.model.encode_images(pixels, [tuple(grid[0].tolist())])[0]
    rows = embedding.shape[0]
    engine = Engine(loaded.model, processor.tokenizer, EngineConfig(kv_cache_bytes=8 << 20, encoder_cache_tokens=rows),
                    torch.device("cpu"))
    assert not engine.embedding_needed("k") and engine.has_room_for(10 * rows)   # nothing pending: always room
    engine.add_embedding("early", embedding)          # no request needs it: pending
    assert engine.holds_embedding("early") and not engine.holds_embedding("k")
    assert engine.has_room_for(0) and not engine.has_room_for(1)    # the cache's capacity is one embedding
    engine.add_request("r", prompt, ["k"], SamplingParams(max_tokens=2))
    assert engine.embedding_needed("k") and engine.embedding_users("k") == {"r"}
    assert engine.request_image_tokens("r", "k") == rows and engine.request_image_tokens("r", "other") is None
    assert engine.request_image_tokens("nobody", "k") is None
    assert engine.load()["waiting"] == 1.0 and engine.load()["pending_embeddings"] == 1.0
    assert set(engine.counters()) >= {"yields", "preemptions"}
    engine.refetch.append("k")
    assert engine.take_refetches() == ["k"] and engine.take_refetches() == []
    engine.abort("r")
    assert not engine.embedding_needed("k") and engine.embedding_users("k") == frozenset()


@pytest.mark.parametrize("aborted", [False, True])
def test_the_service_over_an_engine_that_decodes_ahead_streams_what_a_waiting_one_does(store, tiny_dir, aborted):
    """The real engine on the CPU's fast decode path, with and without
    decode ahead (engine/ahead.py): a step that only launches hands the
    service no outputs, and the next one hands it the last step's. The
    proxy sees the same deltas either way; an abort mid-decode ends only
    its request."""
    loaded = load_model(tiny_dir)
    processor = Processor.from_checkpoint(tiny_dir, loaded.config.image_token_id)

    def streamed(ahead: bool) -> dict:
        engine = Engine(loaded.model, processor.tokenizer,
                        EngineConfig(kv_cache_bytes=8 << 20, fast_decode=True, fast_mixed=False, decode_ahead=ahead),
                        torch.device("cpu"))
        harness = Harness(store, engine)
        got: dict[str, list] = {}
        requests = [protocol.GenerateRequest(f"q{i}", tuple(range(3 + i, 20 + 3 * i)), (), (), (),
                                             protocol.Sampling(6 + 2 * i, ignore_eos=True), PROXY) for i in range(3)]
        sent = harness.turn(*requests)
        for turn in range(200):
            if aborted and turn == 4:
                harness.inbound.put(protocol.AbortRequest(("q1",)))
            for _, rid, tokens, finished, status in deltas(sent):
                got.setdefault(rid, []).append((tokens, finished, status))
            if not engine.has_work():
                break
            sent = harness.turn()
        harness.service.close()
        assert engine.scheduler.block_pool.num_used == 0 and not engine.live
        return got

    waiting, ahead = streamed(False), streamed(True)
    flat = {rid: [t for tokens, _, _ in parts for t in tokens] for rid, parts in ahead.items()}
    want = {rid: [t for tokens, _, _ in parts for t in tokens] for rid, parts in waiting.items()}
    for rid in ("q0", "q2"):
        assert flat[rid] == want[rid] and ahead[rid][-1][1] and len(flat[rid]) == 6 + 2 * int(rid[1:])
    if aborted:   # it streamed a step less before the abort landed: outputs come a step later
        assert flat["q1"] == want["q1"][:len(flat["q1"])] and len(flat["q1"]) < 8
        assert not any(finished for _, finished, _ in ahead["q1"])
    else:
        assert flat["q1"] == want["q1"] and len(flat["q1"]) == 8
