"""Automatic prefix caching (pipeline/engine/prefix_cache.py): the pool that
keeps named blocks, the names, and the scheduler reusing a cached prefix,
checked against a simulated KV cache that records what was computed where."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from pipeline.engine.prefix_cache import PrefixCachingPool, prompt_block_names
from pipeline.engine.request import PENDING_TOKEN, ImageSpan, Request, RequestStatus
from pipeline.sampling_params import SamplingParams
from scheduler_helpers import chunk_map, make_scheduler, step


def request(rid: str, tokens: list[int], spans=(), max_tokens: int = 2) -> Request:
    return Request(rid, list(tokens), tuple(spans), SamplingParams(max_tokens=max_tokens))


def cached_scheduler(**overrides):
    return make_scheduler(prefix_caching=True, **overrides)


def run_to_end(s, limit: int = 100) -> list:
    """Steps until every request is done; what finished meanwhile."""
    finished = []
    for _ in range(limit):
        if not s.has_unfinished():
            return finished
        finished += step(s)[1]
    raise AssertionError("requests did not finish")


# ---- the pool -------------------------------------------------------------

def test_a_named_block_outlives_its_request_and_is_taken_again_by_name():
    pool = PrefixCachingPool(4, 16)
    a, b = pool.allocate(2)
    pool.name(a, b"A")
    pool.free([a, b])
    assert pool.num_free == 4 and pool.num_used == 0 and pool.num_cached == 1
    assert pool.take_cached([b"A", b"B"]) == [a]   # the longest run of names from the first
    assert pool.num_used == 1 and pool.num_free == 3
    assert pool.take_cached([b"A"]) == [a]   # a block may be held twice
    pool.free([a])
    assert pool.is_allocated(a)
    pool.free([a])
    assert not pool.is_allocated(a) and pool.num_cached == 1
    with pytest.raises(ValueError, match="not allocated"):
        pool.free([a])


def test_allocation_takes_unnamed_blocks_first_then_the_oldest_names_a_prompts_last_block_first():
    pool = PrefixCachingPool(4, 16)
    first, second, third, fourth = pool.allocate(4)
    for block, name in ((first, b"1"), (second, b"2"), (third, b"3")):
        pool.name(block, name)
    pool.free([first, second, third, fourth])
    assert pool.allocate(1) == [fourth]   # the unnamed one
    assert pool.num_cached == 3
    assert pool.allocate(1) == [third]   # a prompt's last block loses its name first
    assert pool.take_cached([b"1", b"2", b"3"]) == [first, second]
    assert pool.num_free == 0 and pool.allocate(1) is None
    pool.free([first, second])
    assert pool.allocate(3) is None and pool.num_free == 2   # all or nothing


def test_a_second_block_computed_with_a_name_already_given_stays_unnamed():
    pool = PrefixCachingPool(4, 16)
    a, b = pool.allocate(2)
    pool.name(a, b"X")
    pool.name(b, b"X")
    pool.free([a, b])
    assert pool.num_cached == 1 and pool.take_cached([b"X"]) == [a]


# ---- names ----------------------------------------------------------------

def test_names_follow_every_token_and_every_image_before_them():
    base = list(range(100, 148))   # 3 blocks of 16
    names = prompt_block_names(request("a", base), 16)
    assert len(names) == 3 and len(set(names)) == 3
    assert prompt_block_names(request("b", base + [1, 2, 3]), 16) == names   # a partial block has no name
    changed = base[:20] + [999] + base[21:]
    assert prompt_block_names(request("c", changed), 16)[0] == names[0]
    assert not set(prompt_block_names(request("c", changed), 16)[1:]) & set(names)
    image = lambda key, start=10, offset=0: ImageSpan(start, 12, key, offset=offset, item_tokens=12 + offset)
    with_x = prompt_block_names(request("x", base, [image("x")]), 16)
    with_y = prompt_block_names(request("y", base, [image("y")]), 16)
    assert with_x != names and with_x[0] != with_y[0] and with_x[1] != with_y[1]   # same placeholder ids
    assert prompt_block_names(request("x2", base, [image("x")]), 16) == with_x
    assert prompt_block_names(request("x3", base, [image("x", start=11)]), 16)[0] != with_x[0]
    assert prompt_block_names(request("x4", base, [image("x", offset=4)]), 16)[0] != with_x[0]   # other rows


# ---- the scheduler --------------------------------------------------------

def test_a_prompt_seen_before_starts_after_its_cached_blocks_and_counts_as_hits():
    s = cached_scheduler(block_size=4)
    s.add_request(request("a", range(100, 110)))
    run_to_end(s)
    assert s.block_pool.num_used == 0 and s.block_pool.num_free == 64
    s.add_request(request("b", list(range(100, 110)) + [5, 6]))
    plan, _ = step(s)
    assert chunk_map(plan)["b"] == (8, 4)   # blocks [0, 8) reused; a's third block was partial
    assert s.prefix.queries == 22 and s.prefix.hits == 8
    assert s.get_request("b").num_cached_tokens == 8
    (finished,) = run_to_end(s)
    assert finished.request_id == "b" and finished.num_cached_tokens == 8
    # A whole prompt cached: its last block is computed again, for the logits of its last token.
    s.add_request(request("c", range(100, 108)))
    plan, _ = step(s)
    assert chunk_map(plan)["c"] == (4, 4)
    run_to_end(s)
    assert s.block_pool.num_used == 0 and s.block_pool.num_free == 64


def test_an_answer_s_computed_blocks_are_kept_for_the_next_turn():
    s = cached_scheduler(block_size=4)
    s.add_request(request("a", range(100, 110), max_tokens=6))   # 16 tokens; the last is never computed
    run_to_end(s)
    # The next turn: a's prompt, its answer (the test sampler's 7s), more words.
    s.add_request(request("b", list(range(100, 110)) + [7] * 6 + [5, 6]))
    plan, _ = step(s)
    assert chunk_map(plan)["b"] == (12, 6)   # a's third block held prompt and answer; its fourth was partial
    run_to_end(s)
    s.add_request(request("c", list(range(100, 110)) + [7, 8, 8, 8, 9]))   # another answer
    plan, _ = step(s)
    assert chunk_map(plan)["c"] == (8, 7)


def test_a_block_with_a_token_still_on_the_device_is_not_named():
    s = cached_scheduler(block_size=4)
    s.add_request(request("a", range(100, 107), max_tokens=20))
    step(s)                               # the prompt; its first token read
    for _ in range(5):                    # decode ahead: planned and counted, tokens never read
        s.advance(s.schedule())
    a = s.get_request("a")
    assert a.num_computed_tokens == 12 and a.output_token_ids[1:] == [PENDING_TOKEN] * 5
    s.finish("a", RequestStatus.FINISHED_ABORTED)
    assert s.block_pool.num_cached == 2   # positions 0-7 (a's first token at 7); 8-11 were pending
    s.add_request(request("b", list(range(100, 107)) + [7, 1, 1, 1, 1, 1]))
    plan, _ = step(s)
    assert chunk_map(plan)["b"] == (8, 5)


def test_only_requests_with_the_same_cache_salt_share_blocks():
    s = cached_scheduler(block_size=4)
    s.add_request(request("a", range(100, 110)))
    run_to_end(s)
    for rid, salt, reused in (("b", "tenant-1", 0), ("c", "tenant-1", 8), ("d", "tenant-2", 0), ("e", "", 8)):
        r = request(rid, range(100, 110))
        r.cache_salt = salt
        s.add_request(r)
        plan, _ = step(s)
        assert chunk_map(plan)[rid][0] == reused, rid
        run_to_end(s)


def test_a_reuse_is_given_back_when_the_request_is_not_admitted():
    s = cached_scheduler(block_size=4, num_blocks=6, max_num_seqs=2)
    s.add_request(request("a", range(100, 112)))
    run_to_end(s)
    s.add_request(request("long", range(500, 512), max_tokens=4))   # holds 3 blocks, its 4th later
    s.add_request(request("b", list(range(100, 112)) + list(range(1, 9))))   # 3 reused + 2 new: no room
    plan, _ = step(s)
    assert set(chunk_map(plan)) == {"long"} and [r.request_id for r in s.waiting] == ["b"]
    b = s.get_request("b")
    assert b.num_computed_tokens == 0 and len(b.block_ids) == 0
    assert s.block_pool.num_used == 3 and s.prefix.hits == 0
    run_to_end(s)
    # long's 4th block took the oldest named block, a's third: b found two.
    assert s.prefix.hits == 8 and s.block_pool.num_used == 0


def test_an_image_inside_a_cached_prefix_is_not_read_again():
    s = cached_scheduler(block_size=4)
    span = ImageSpan(2, 8, "img")
    s.add_request(request("a", range(100, 114), [span]))
    assert s.admit_embedding("img", 8)
    run_to_end(s)
    s.encoder_cache.free_unused()
    assert not s.embedding_available("img")
    s.add_request(request("b", list(range(100, 114)) + [1], [span]))
    plan, _ = step(s)   # the embedding is gone, and b does not need it
    assert chunk_map(plan)["b"] == (12, 3) and not plan.chunks[0].image_spans_in_chunk
    assert not s.encoder_cache.users("img")


def test_a_preempted_request_finds_its_prompt_blocks_again():
    s = cached_scheduler(block_size=4, num_blocks=8, max_num_batched_tokens=64)
    s.add_request(request("a", range(100, 116), max_tokens=12))   # 4 blocks, 7 by its end
    s.add_request(request("b", range(200, 208), max_tokens=12))   # 2 blocks, 5 by its end
    for _ in range(40):
        plan, _ = step(s)
        if plan.preempted:
            break
    assert plan.preempted == ["b"]
    plan, _ = step(s)
    while "b" not in chunk_map(plan):
        plan, _ = step(s)
    # Its first prompt block reused: a's growth, with no unnamed block left, took the second.
    assert chunk_map(plan)["b"][0] == 4
    assert s.get_request("b").num_cached_tokens == 0   # what its first admission found, as vLLM counts
    run_to_end(s)
    assert s.block_pool.num_used == 0


# ---- property: every reused block holds what its request would compute ----

def fake_kv(tokens: list[int], media: list[str | None], position: int) -> tuple:
    """What the KV at `position` depends on: every token and medium up to it."""
    return tuple(zip(tokens[:position + 1], media[:position + 1]))


def prompt_media(r: Request) -> list[str | None]:
    media: list[str | None] = [None] * r.num_prompt_tokens
    for span in r.image_spans:
        for i in range(span.length):
            media[span.start + i] = f"{span.key}:{span.offset + i}"
    return media


# The test's sampler gives every request token 7, so prompts with 7s can
# start as an earlier request's prompt and answer did (a chat's next turn).
TOKENS = st.sampled_from([1, 2, 3, 7])


@st.composite
def workloads(draw):
    stems = draw(st.lists(st.lists(TOKENS, min_size=1, max_size=12), min_size=1, max_size=3))
    requests, turns = [], []
    for i in range(draw(st.integers(1, 10))):
        tokens = list(draw(st.sampled_from(stems))) + draw(st.lists(TOKENS, max_size=10))
        spans = []
        if len(tokens) >= 4 and draw(st.booleans()):
            start = draw(st.integers(0, len(tokens) - 3))
            spans = [ImageSpan(start, 3, draw(st.sampled_from(["p", "q"])))]
        max_tokens = draw(st.integers(1, 6))
        requests.append(request(f"r{i}", tokens, spans, max_tokens=max_tokens))
        if draw(st.booleans()):   # its next turn, sent later: its prompt, its answer (all 7s), and more
            turn = tokens + [7] * max_tokens + draw(st.lists(TOKENS, max_size=3))
            turns.append(request(f"r{i}+", turn, spans, max_tokens=draw(st.integers(1, 6))))
    return requests + turns, draw(st.integers(11, 24)), draw(st.integers(1, 3))   # 11 blocks: the longest request


@settings(max_examples=150, deadline=None)
@given(workloads())
def test_reused_blocks_hold_exactly_the_kv_their_request_would_compute(workload):
    """A simulated KV cache: each step writes, for each chunk, what each
    position's KV depends on into the request's blocks. Before it does, every
    position the chunk attends to (all before its start) must hold the
    request's own values: a reused block came from an equal prefix, and no
    block another request still reads was written."""
    requests, num_blocks, arrivals_per_step = workload
    block = 4
    s = cached_scheduler(block_size=block, num_blocks=num_blocks, max_num_batched_tokens=16,
                         encoder_cache_tokens=64)
    kv: dict[tuple[int, int], tuple] = {}
    pending = list(requests)
    for _ in range(400):
        for r in pending[:arrivals_per_step]:
            s.add_request(r)
            for span in r.image_spans:
                s.admit_embedding(span.key, span.item_tokens)
        pending = pending[arrivals_per_step:]
        if not pending and not s.has_unfinished():
            break
        plan = s.schedule()
        for key in plan.refetch_keys:   # a preempted request's images, asked for again
            s.admit_embedding(key, 3)
        for chunk in plan.chunks:
            r = s.get_request(chunk.request_id)
            tokens = r.all_token_ids
            media = prompt_media(r) + [None] * r.num_output_tokens
            table = r.block_ids.tolist()
            for p in range(chunk.start):
                assert kv[table[p // block], p % block] == fake_kv(tokens, media, p), (chunk, p)
            for p in range(chunk.start, chunk.end):
                kv[table[p // block], p % block] = fake_kv(tokens, media, p)
        s.update(plan, {c.request_id: 7 for c in plan.chunks if c.sample})
    assert not s.has_unfinished() and s.block_pool.num_used == 0
