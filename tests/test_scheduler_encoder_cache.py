"""The generator scheduler under encoder-cache pressure and in aggregated
mode, and randomized runs that check every ledger after each step (fake
model outputs, as in test_scheduler.py)."""

from __future__ import annotations

import random

import pytest

from pipeline.engine.encoder_cache import EncoderCache
from pipeline.engine.request import ImageSpan
from pipeline.engine.scheduler import Chunk, Scheduler, StepPlan
from scheduler_helpers import chunk_map, make_request, make_scheduler, running_ids, step, waiting_ids

# ---------------------------------------------------------- aggregated mode


def test_aggregated_local_encode_budget():
    s = make_scheduler(aggregated=True, local_encode_tokens=16, encoder_cache_tokens=64)
    a, b = ImageSpan(4, 12, "a"), ImageSpan(20, 12, "b")
    s.add_request(make_request("A", 40, spans=[a, b]))
    plan, _ = step(s)
    # a fits the 16-token encode budget; b would make 24, so the chunk stops at 20.
    assert plan.encode_keys == ["a"] and plan.chunks == [Chunk("A", 0, 20, (a,))]
    plan, _ = step(s)
    assert plan.encode_keys == ["b"] and plan.chunks == [Chunk("A", 20, 20, (b,), sample=True)]


def test_aggregated_encodes_only_spans_the_chunk_reaches_and_shares_keys():
    s = make_scheduler(aggregated=True, local_encode_tokens=32, max_num_batched_tokens=10)
    a, b = ImageSpan(4, 4, "a"), ImageSpan(12, 4, "b")
    s.add_request(make_request("A", 20, spans=[a, b]))
    plan = s.schedule()
    assert plan.encode_keys == ["a"] and plan.chunks == [Chunk("A", 0, 10, (a,))]
    assert s.encoder_cache.contains("a") and s.encoder_cache.get("a") is None   # reserved
    assert not s.encoder_cache.contains("b")
    s.encoder_cache.set_payload("a", "A")
    s.update(plan, {})
    s2 = make_scheduler(aggregated=True, local_encode_tokens=8)
    s2.add_request(make_request("P", 6, spans=[ImageSpan(0, 4, "k")]))
    s2.add_request(make_request("Q", 6, spans=[ImageSpan(2, 4, "k")]))
    plan = s2.schedule()
    assert plan.encode_keys == ["k"] and chunk_map(plan) == {"P": (0, 6), "Q": (0, 6)}


def test_aggregated_encodes_respect_the_encoder_cache():
    s = make_scheduler(aggregated=True, local_encode_tokens=32, encoder_cache_tokens=12)
    s.add_request(make_request("A", 30, spans=[ImageSpan(2, 12, "a"), ImageSpan(16, 12, "b")]))
    plan, _ = step(s)
    assert plan.encode_keys == ["a"] and chunk_map(plan) == {"A": (0, 16)}
    plan, _ = step(s)   # a was consumed and freed, so b fits now
    assert plan.encode_keys == ["b"] and chunk_map(plan) == {"A": (16, 14)}


# ------------------------------------------------- encoder-cache pressure


def test_make_room_evicts_unprotected_entries_in_order():
    cache = EncoderCache(capacity_tokens=12)
    for key, users in (("used", ["r1"]), ("late", ["r2"]), ("free", [])):
        for rid in users:
            cache.add_user(key, rid)
        cache.admit(key, 4)
    assert cache.make_room(12, protected={"used"}, last_resort={"late"}) is None
    assert len(cache) == 3                                   # refused: nothing evicted
    assert cache.make_room(4, protected=set(), last_resort={"late"}) == ["free"]
    assert cache.make_room(8, protected=set(), last_resort={"late"}) == ["used"]
    assert cache.users("used") == {"r1"}                     # users wait for it again
    assert cache.drain_freed() == ["free", "used"]


def test_arrival_for_a_blocked_request_evicts_images_needed_later():
    s = make_scheduler(encoder_cache_tokens=12, max_num_seqs=1)
    s.add_request(make_request("W", 24, spans=[ImageSpan(0, 4, "w0"), ImageSpan(8, 12, "w1")]))
    s.add_request(make_request("A", 20, spans=[ImageSpan(0, 12, "a")]))
    assert s.admit_embedding("w1", 12)                       # W's later image fills the cache
    plan, _ = step(s)
    assert plan.yielded == ["W", "A"] and plan.chunks == []
    assert not s.admit_embedding("x", 4)                     # nobody reads x next
    assert s.admit_embedding("w0", 4)                        # W reads w0 next: w1 is evicted
    assert s.encoder_cache.keys() == ["w0"] and s.encoder_cache.users("w1") == {"W"}
    assert not s.admit_embedding("a", 12)                    # a waiting request's next image stays
    plan, _ = step(s)
    assert plan.refetch_keys == ["w1"] and chunk_map(plan) == {"W": (0, 8)}
    assert s.admit_embedding("a", 12)                        # w0 was consumed: room again
    # Running W is blocked on w1; waiting A's next image is evicted for it.
    assert s.admit_embedding("w1", 12) and s.encoder_cache.keys() == ["w1"]
    plan, _ = step(s)
    assert plan.refetch_keys == ["a"] and chunk_map(plan) == {"W": (8, 16)}


def test_arrival_never_evicts_what_a_planned_chunk_reads():
    s = make_scheduler(encoder_cache_tokens=12)
    s.add_request(make_request("A", 12, spans=[ImageSpan(0, 4, "a1"), ImageSpan(4, 4, "a2")]))
    s.add_request(make_request("B", 12, spans=[ImageSpan(0, 8, "b")]))
    s.admit_embedding("a1", 4)
    s.admit_embedding("a2", 4)
    plan = s.schedule()
    assert chunk_map(plan) == {"A": (0, 12)} and plan.yielded == ["B"]
    # a2 is nobody's next image, but the plan in flight reads it.
    assert not s.admit_embedding("b", 8)
    s.update(plan, {"A": 7})
    assert s.admit_embedding("b", 8)                         # a1 and a2 were consumed


def test_arrival_with_a_wrong_token_count_is_an_error():
    s = make_scheduler()
    s.add_request(make_request("A", 12, spans=[ImageSpan(0, 8, "a")]))
    with pytest.raises(ValueError, match="placeholder"):
        s.admit_embedding("a", 9)
    assert not s.encoder_cache.contains("a")


def test_aggregated_encode_evicts_an_image_needed_only_later():
    s = make_scheduler(aggregated=True, local_encode_tokens=12, encoder_cache_tokens=12,
                       max_num_seqs=1)
    a, b = ImageSpan(0, 6, "a"), ImageSpan(10, 10, "b")
    s.add_request(make_request("X", 10, max_tokens=1, spans=[ImageSpan(0, 10, "b")]))
    s.add_request(make_request("W", 24, spans=[a, b]))
    plan, finished = step(s)
    assert plan.encode_keys == ["b"] and chunk_map(plan) == {"X": (0, 10)}
    assert [f.request_id for f in finished] == ["X"]
    assert s.encoder_cache.keys() == ["b"] and s.encoder_cache.users("b") == {"W"}
    plan, _ = step(s)
    # `a` (6) does not fit beside `b` (10), which W reads only later: `b` is
    # evicted, and the chunk stops at the end of `a` so it reads nothing else.
    assert plan.encode_keys == ["a"] and plan.chunks == [Chunk("W", 0, 6, (a,))]
    assert s.encoder_cache.keys() == []                      # `a` consumed, `b` evicted
    plan, _ = step(s)
    assert plan.encode_keys == ["b"] and plan.chunks == [Chunk("W", 6, 18, (b,), sample=True)]


# ------------------------------------------------------------ randomized run


def check_plan(s: Scheduler, plan: StepPlan) -> None:
    cfg = s.config
    assert plan.num_batched_tokens <= cfg.max_num_batched_tokens
    assert len(plan.chunks) <= cfg.max_num_seqs and s.num_running <= cfg.max_num_seqs
    ids = [c.request_id for c in plan.chunks]
    assert len(ids) == len(set(ids))
    running = {r.request_id: r for r in s.running}
    for c in plan.chunks:
        r = running[c.request_id]
        assert c.start == r.num_computed_tokens and c.num_tokens >= 1
        assert len(r.block_ids) * cfg.block_size >= c.end
        for span in c.image_spans_in_chunk:
            assert s.encoder_cache.contains(span.key)             # only local embeddings are read
    assert not set(plan.yielded) & set(ids)
    encode_total = sum(s.encoder_cache.num_tokens(k) for k in plan.encode_keys)
    assert encode_total <= cfg.local_encode_tokens
    reached = {sp.key for c in plan.chunks for sp in c.image_spans_in_chunk}
    assert set(plan.encode_keys) <= reached


def check_ledgers(s: Scheduler) -> None:
    cfg = s.config
    waiting, running = set(waiting_ids(s)), set(running_ids(s))
    assert not waiting & running
    assert len(waiting) == s.num_waiting and len(running) == s.num_running
    owned = [b for r in s.running for b in r.block_ids]
    assert len(owned) == len(set(owned)) == s.block_pool.num_used
    assert all(s.block_pool.is_allocated(b) for b in owned)
    assert s.block_pool.num_used + s.block_pool.num_free == cfg.num_blocks
    assert all(r.block_ids == [] for r in s.waiting)
    cache = s.encoder_cache
    assert cache.used_tokens <= cfg.encoder_cache_tokens
    assert cache.used_tokens == sum(cache.num_tokens(k) for k in cache.keys())
    for r in list(s.waiting) + s.running:
        for key in r.keys_still_needed():
            assert r.request_id in cache.users(key)


class FakeEngine:
    """Random arrivals of requests with random images; in disaggregated mode
    embeddings arrive 1-11 steps after they are asked for, and wait in
    `pending` while the cache has no room for them."""

    def __init__(self, s: Scheduler, rng: random.Random, max_images: int) -> None:
        self.s, self.rng, self.max_images = s, rng, max_images
        self.key_len = {f"img{i}": rng.randint(1, 12) for i in range(12)}
        self.arrivals: dict[int, list[str]] = {}
        self.pending: list[str] = []
        self.added = self.finished = self.aborted = 0

    def ask_encoders(self, now: int, keys) -> None:
        for key in keys:
            self.arrivals.setdefault(now + 1 + self.rng.randint(0, 10), []).append(key)

    def add_random_request(self, now: int) -> None:
        spans, pos = [], 0
        for _ in range(self.rng.randint(0, self.max_images)):
            gap, key = self.rng.randint(0, 6), self.rng.choice(list(self.key_len))
            spans.append(ImageSpan(pos + gap, self.key_len[key], key))
            pos += gap + self.key_len[key]
        prompt_len = max(1, pos + self.rng.randint(0, 10))
        self.s.add_request(make_request(f"r{self.added}", prompt_len, spans=spans, eos=[0],
                                        max_tokens=self.rng.randint(1, 12)))
        self.added += 1
        if not self.s.config.aggregated:
            self.ask_encoders(now, sorted({sp.key for sp in spans}))

    def step(self, now: int) -> None:
        s = self.s
        if not s.config.aggregated:
            self.pending += self.arrivals.pop(now, [])
            self.pending = [k for k in self.pending if s.encoder_cache.is_needed(k)
                            and not s.admit_embedding(k, self.key_len[k])]
        plan = s.schedule()
        check_plan(s, plan)
        check_ledgers(s)
        self.ask_encoders(now, plan.refetch_keys)
        sampled = {c.request_id: self.rng.randint(0, 20) for c in plan.chunks if c.sample}
        self.finished += len(s.update(plan, sampled))
        check_ledgers(s)
        s.encoder_cache.drain_freed()


def assert_all_free(s: Scheduler) -> None:
    s.schedule()   # frees arrivals nobody needs any more
    assert s.num_waiting == 0 and s.num_running == 0 and not s.has_unfinished()
    assert s.block_pool.num_used == 0 and s.block_pool.num_free == s.config.num_blocks
    assert len(s.encoder_cache) == 0 and s.encoder_cache.used_tokens == 0
    assert s.encoder_cache.num_users_total() == 0


@pytest.mark.parametrize("aggregated", [False, True])
def test_randomized_run_keeps_every_ledger(aggregated):
    rng = random.Random(1234 + aggregated)
    s = make_scheduler(max_num_batched_tokens=48, max_num_seqs=6, block_size=4, num_blocks=24,
                       encoder_cache_tokens=40, aggregated=aggregated,
                       local_encode_tokens=12 if aggregated else 0)
    engine = FakeEngine(s, rng, max_images=2)
    for now in range(300):
        if now < 260 and rng.random() < 0.45:
            engine.add_random_request(now)
        if rng.random() < 0.03 and (s.running or s.waiting):
            victim = rng.choice(list(s.waiting) + s.running).request_id
            engine.aborted += s.abort(victim)
        engine.step(now)
    for r in list(s.waiting) + s.running:
        engine.aborted += s.abort(r.request_id)
    assert engine.finished + engine.aborted == engine.added
    assert engine.finished >= 80
    assert s.stats["yields_total"] > 0 and s.stats["preemptions_total"] > 0
    assert_all_free(s)


@pytest.mark.parametrize("aggregated", [False, True])
def test_small_encoder_cache_never_deadlocks(aggregated):
    """A cache that holds one image at most, three images per request, shared
    keys and preemptions: every request still finishes, none is aborted."""
    rng = random.Random(99 + aggregated)
    s = make_scheduler(max_num_batched_tokens=16, max_num_seqs=3, block_size=4, num_blocks=16,
                       encoder_cache_tokens=12, aggregated=aggregated,
                       local_encode_tokens=12 if aggregated else 0)
    engine = FakeEngine(s, rng, max_images=3)
    now = 0
    while now < 150 or s.has_unfinished():
        if now < 150 and rng.random() < 0.4:
            engine.add_random_request(now)
        engine.step(now)
        now += 1
        assert now < 5000, "no progress: the scheduler is stuck"
    assert engine.finished == engine.added >= 40
    assert s.stats["preemptions_total"] > 0
    assert_all_free(s)
