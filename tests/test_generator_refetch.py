"""The generator's side of issue 19's failover, on fakes: lost embeddings are
asked for again (of their encoder, then of the proxy) within deadlines, and
fallback encodes run the tower on what the receiver decoded."""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from types import SimpleNamespace

import torch

from pipeline import protocol
from pipeline.engine.encoder_cache import EncoderCache
from pipeline.generator.early_arrivals import EarlyArrivals
from pipeline.generator.key_sources import KeySources
from pipeline.generator.local_encode import DecodedJob, LocalEncoder, decode_job, encode_local
from pipeline.generator.media_budget import HeldBytes
from pipeline.generator.refetch import (FETCH_WAIT_S, MAX_WANTS, Refetches, expire_refetches, handed_back,
                                        refetch_evicted, want_again)
from pipeline.generator.requests import RequestTable

WANT_S = 20.0


class FakeEngine:
    """The Engine queries refetch.py and intake.py make, over a real encoder cache."""

    def __init__(self, cache: EncoderCache, requests: dict) -> None:
        self.cache, self.requests = cache, requests
        self.refetch: list[str] = []
        self.added: list[tuple[str, tuple]] = []

    def take_refetches(self) -> list[str]:
        keys, self.refetch = self.refetch, []
        return keys

    def embedding_users(self, key):
        return self.cache.users(key)

    def embedding_needed(self, key) -> bool:
        return self.cache.is_needed(key)

    def request_image_tokens(self, request_id, key):
        request = self.requests.get(request_id)
        return next((s.item_tokens for s in request.image_spans if s.key == key), None) if request else None

    def add_embedding(self, key, embedding) -> None:
        self.added.append((key, tuple(embedding.shape)))


class FakeService:
    """What refetch.py and local_encode.py use of a GeneratorService: an
    encoder cache whose users are the requests, and what is sent and failed."""

    def __init__(self, users: dict[str, list[str]], sources: dict[str, str] | None = None) -> None:
        cache = EncoderCache(1000)
        known = {}
        for key, rids in users.items():
            for rid in rids:
                cache.add_user(key, rid)
                known[rid] = SimpleNamespace(request_id=rid, image_spans=[SimpleNamespace(key=key, item_tokens=16)])
        self.engine = FakeEngine(cache, known)
        self.key_sources = KeySources(60.0)
        for key, address in (sources or {}).items():
            self.key_sources.remember(key, address)
        self.requests = RequestTable()
        for rid in known:
            self.requests.track(rid, f"proxy-of-{rid}", math.inf)
        self.refetches = Refetches(WANT_S)
        self.early = EarlyArrivals(60.0)
        self.counters: Counter[str] = Counter()
        self.address = "gen"
        self.sent, self.failed, self.released = [], [], []
        self.local = None

    def send(self, address, message) -> bool:
        self.sent.append((address, message))
        return True

    def fail_key(self, key, reason, status=500) -> None:
        self.failed.append((key, reason, status))

    def release(self, ready) -> None:
        self.released.append(ready.lease_id)

    def take_sent(self) -> list:
        sent, self.sent = self.sent, []
        return sent


def test_the_ledger_asks_the_encoder_then_the_proxy_then_gives_up():
    asks, needed = Refetches(WANT_S), lambda key: key != "unneeded"
    assert asks.start_fetch("k", 0.0) and not asks.start_fetch("k", 0.0)   # one ask at a time
    assert asks.overdue(FETCH_WAIT_S - 0.1, needed) == ([], [])
    assert asks.overdue(FETCH_WAIT_S + 0.1, needed) == (["k"], [])          # its encoder is silent
    assert asks.start_want("k", 10.0)
    assert asks.overdue(10.0 + WANT_S - 0.1, needed) == ([], [])
    assert asks.overdue(10.0 + WANT_S + 0.1, needed) == ([], ["k"]) and len(asks) == 0

    assert all(asks.start_want("bad", 0.0) for _ in range(MAX_WANTS))       # lost again after each delivery
    assert not asks.start_want("bad", 0.0) and len(asks) == 0

    asks.start_fetch("parked", 0.0)
    asks.answered("parked")                  # its handle waits for room here: no deadline
    assert asks.overdue(1e9, needed) == ([], []) and "parked" in asks
    asks.arrived("parked")
    assert "parked" not in asks
    asks.start_fetch("unneeded", 0.0)
    assert asks.overdue(1e9, needed) == ([], []) and len(asks) == 0


def test_an_evicted_embedding_is_fetched_from_its_encoder_then_wanted_of_the_proxy_then_failed():
    service = FakeService({"k": ["r1", "r2"]}, {"k": "enc-a"})
    service.engine.refetch = ["k"]
    refetch_evicted(service)
    ((address, fetch),) = service.take_sent()
    assert address == "enc-a" and isinstance(fetch, protocol.FetchEmbedding)
    assert (fetch.content_hash, fetch.consumer, fetch.expected_tokens) == ("k", "gen", 16)
    service.engine.refetch = ["k"]      # evicted again before the answer: not asked twice
    refetch_evicted(service)
    assert not service.sent and service.engine.refetch == []

    now = time.monotonic()
    expire_refetches(service, now + FETCH_WAIT_S / 2)
    assert not service.sent
    expire_refetches(service, now + FETCH_WAIT_S + 1)   # the encoder died: every user's proxy is asked
    wanted = sorted(service.take_sent(), key=lambda sent: sent[0])
    assert [(a, m.request_id, m.content_hashes, m.consumer) for a, m in wanted] == \
        [("proxy-of-r1", "r1", ("k",), "gen"), ("proxy-of-r2", "r2", ("k",), "gen")]
    assert all(isinstance(m, protocol.EmbeddingWanted) and "did not answer" in m.reason and m.encoder == "enc-a"
               for _, m in wanted)

    expire_refetches(service, time.monotonic() + WANT_S - 1)
    assert not service.failed
    expire_refetches(service, time.monotonic() + WANT_S + 1)
    ((key, reason, status),) = service.failed
    assert key == "k" and status == 503 and "retry" in reason
    assert service.counters == Counter({"refetches.encoder": 1, "refetches.proxy": 1, "refetches.failed": 1})
    assert len(service.refetches) == 0


def test_a_delivery_clears_the_ask_and_an_unknown_source_goes_to_the_proxy_at_once():
    service = FakeService({"k": ["r1"], "nobody-knows": ["r1"], "unused": []})
    service.engine.refetch = ["nobody-knows", "unused"]
    refetch_evicted(service)
    ((address, wanted),) = service.take_sent()
    assert address == "proxy-of-r1" and wanted.content_hashes == ("nobody-knows",)
    service.refetches.arrived("nobody-knows")   # read: nothing owed
    expire_refetches(service, time.monotonic() + 10 * WANT_S)
    assert not service.sent and not service.failed and len(service.refetches) == 0


def test_a_key_lost_again_after_every_delivery_fails_its_requests():
    service = FakeService({"k": ["r1"]})
    for _ in range(MAX_WANTS):
        want_again(service, "k", "unreadable: stale")
    assert len(service.take_sent()) == MAX_WANTS and not service.failed
    want_again(service, "k", "unreadable: stale")
    assert not service.sent
    ((key, reason, status),) = service.failed
    assert key == "k" and status == 503 and f"lost {MAX_WANTS} times" in reason


def test_a_handle_given_back_for_an_ended_request_is_asked_for_again_for_the_others():
    service = FakeService({"k": ["r2"]}, {"k": "enc-a"})
    service.engine.refetch = ["k"]
    refetch_evicted(service)
    service.take_sent()
    service.refetches.answered("k")          # the answer came for r1, which then ended
    handle = protocol.ArenaHandle("a", 0, 4, (1, 1), "float32", 1)
    handed_back(service, protocol.EmbeddingReady("k-for-r3", "r3", "k", handle, "lease-0", "enc"))
    assert not service.sent          # a job of r3's own: r2 gets one of its own too
    handed_back(service, protocol.EmbeddingReady("refetch-k", "r1", "k", handle, "lease-1", "enc"))
    ((address, wanted),) = service.take_sent()
    assert service.released == ["lease-0", "lease-1"] and address == "proxy-of-r2" and wanted.request_id == "r2"
    assert wanted.encoder == ""              # that encoder answered: it may have the job again
    handed_back(service, protocol.EmbeddingReady("refetch-other", "r9", "other", handle, "lease-2", "enc"))
    assert service.released[-1] == "lease-2" and not service.sent   # nothing was asked for it


def job(rid: str, tokens: int, key: str = "") -> protocol.EncodeJob:
    return protocol.EncodeJob(f"{rid}/0", rid, key or f"key-{rid}", b"bytes", "gen", tokens, f"proxy-of-{rid}")


def fake_forward(calls: list):
    """A tower whose item i has grid (1, rows, 1) and as many output rows."""
    def forward(pixels, grids):
        calls.append(len(grids))
        return [torch.full((grid[1], 8), float(len(calls))) for grid in grids]
    return forward


def decoded(rid: str, tokens: int, rows: int | None = None) -> DecodedJob:
    return DecodedJob(job(rid, tokens), torch.zeros(rows or tokens, 4), (1, rows or tokens, 1))


def test_fallback_encodes_run_in_batches_under_the_token_budget():
    calls = []
    local = LocalEncoder(fake_forward(calls), None, torch.device("cpu"), max_tokens=20)
    local.queue.extend([decoded("a", 8), decoded("gone", 8), decoded("b", 8), decoded("c", 8),
                        DecodedJob(job("bad", 8), error="bad image: truncated"), decoded("wrong", 8, rows=5),
                        decoded("big", 30)])
    first = local.encode_some(lambda rid: rid == "gone")
    assert [(r.job.request_id, r.embedding is not None) for r in first] == [("a", True), ("b", True)]
    assert calls == [2]
    second = local.encode_some(lambda rid: False)
    assert [(r.job.request_id, r.error[:12]) for r in second] == \
        [("bad", "bad image: t"), ("c", ""), ("wrong", "the image ha")]
    assert not second[0].retryable and calls == [2, 2]
    (alone,) = local.encode_some(lambda rid: False)     # past the budget by itself: encoded alone
    assert alone.job.request_id == "big" and alone.embedding.shape == (30, 8) and not local.queue


def test_a_failed_forward_fails_its_jobs_retryably_and_not_the_generator():
    def broken(pixels, grids):
        raise RuntimeError("device lost")
    local = LocalEncoder(broken, None, torch.device("cpu"), max_tokens=100)
    local.queue.extend([decoded("a", 4), decoded("b", 4)])
    results = local.encode_some(lambda rid: False)
    assert [(r.retryable, "device lost" in r.error) for r in results] == [(True, True)] * 2


def test_encode_local_hands_embeddings_to_the_engine_and_failures_to_the_proxy():
    service = FakeService({})
    service.local = LocalEncoder(fake_forward([]), None, torch.device("cpu"), max_tokens=100)
    service.local.queue.extend([decoded("a", 6), DecodedJob(job("bad", 6), error="bad image: empty"),
                                decoded("ended", 6)])
    service.requests.end("ended")
    encode_local(service)
    assert service.engine.added == [("key-a", (6, 8))] and service.counters["fallback_encodes"] == 1
    assert [(k, tuple(t.shape)) for k, t in service.early.claim("a")] == [("key-a", (6, 8))]   # "a" not here yet
    ((address, failed),) = service.sent
    assert address == "proxy-of-bad" and isinstance(failed, protocol.EncodeFailed)
    assert (failed.job_id, failed.retryable, failed.encoder_id) == ("bad/0", False, "gen")


def test_a_receiver_worker_decodes_within_the_budget_and_reports_bad_media():
    budget, stop = HeldBytes(1 << 20), threading.Event()
    pixels = torch.zeros(16, 4)
    good = decode_job(job("a", 4), lambda j: (pixels, [1, 4, 4]), budget, stop)
    assert good.pixels is pixels and good.grid == (1, 4, 4) and not good.error
    assert budget.held == pixels.untyped_storage().nbytes()

    def bad(j):
        raise ValueError("bad image: not an image")

    def broken(j):
        raise OSError("backend gone")

    assert decode_job(job("b", 4), bad, budget, stop).error == "bad image: not an image"
    assert decode_job(job("c", 4), broken, budget, stop).error == "media decoding failed: backend gone"


def test_nothing_is_asked_for_a_key_nobody_waits_for():
    service = FakeService({"k": []})
    want_again(service, "k", "gone")
    assert not service.sent and not service.failed and len(service.refetches) == 0
