"""The generator scheduler on the CPU, driven with fake model outputs.

A test engine calls schedule() and update() in a loop; the "sampler" returns a
fixed or scripted token for every chunk due a sample, and embeddings "arrive"
by admitting keys into the scheduler's encoder cache.
"""

from __future__ import annotations

import pytest

from pipeline.engine.encoder_cache import EncoderCache
from pipeline.engine.kv_blocks import BlockPool, blocks_needed, num_blocks_for_memory
from pipeline.engine.request import ImageSpan, Request, RequestStatus
from pipeline.sampling_params import SamplingParams
from pipeline.engine.scheduler import Chunk
from scheduler_helpers import chunk_map, make_request, make_scheduler, running_ids, step, waiting_ids

# --------------------------------------------------------------- kv blocks


def test_block_pool_all_or_nothing_and_double_free():
    pool = BlockPool(num_blocks=4, block_size=16)
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.num_used == 3 and pool.num_free == 1
    assert pool.allocate(2) is None
    assert pool.num_free == 1 and pool.num_used == 3      # a failed allocation took nothing
    pool.free(a[:2])
    with pytest.raises(ValueError):
        pool.free([a[0]])                                   # double free
    with pytest.raises(ValueError):
        pool.free([a[2], a[2]])                             # same id twice in one call
    assert pool.num_used == 1                               # the refused frees changed nothing
    with pytest.raises(ValueError):
        pool.free([99])
    assert pool.allocate(0) == []
    assert blocks_needed(0, 16) == 0 and blocks_needed(1, 16) == 1
    assert blocks_needed(16, 16) == 1 and blocks_needed(17, 16) == 2
    # 2 (K and V) * 2 layers * 4 heads * 8 dims * 2 bytes * 16 tokens = 4096 bytes per block
    assert num_blocks_for_memory(10_000, 2, 4, 8, 2, 16) == 2
    with pytest.raises(ValueError):
        BlockPool(0, 16)


# ------------------------------------------------------------------ request


@pytest.mark.parametrize("kwargs", [
    dict(max_tokens=0), dict(max_tokens=4, min_tokens=5), dict(max_tokens=4, temperature=-1.0),
    dict(max_tokens=4, temperature=float("nan")), dict(max_tokens=4, top_k=-1),
    dict(max_tokens=4, top_p=0.0), dict(max_tokens=4, top_p=1.5), dict(max_tokens=4, seed=-3),
    dict(max_tokens=4, stop_token_ids=(-1,)), dict(max_tokens=4, stop=("",)),
    dict(max_tokens=True), dict(max_tokens=4, ignore_eos=1),
])
def test_sampling_params_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_request_validation_and_properties():
    params = SamplingParams(max_tokens=3, stop_token_ids=[5], stop=["x"])
    assert params.stop_token_ids == (5,) and params.stop == ("x",)
    with pytest.raises(ValueError):
        ImageSpan(0, 0, "k")
    with pytest.raises(ValueError):
        make_request("r", 4, spans=[ImageSpan(2, 4, "k")])          # past the prompt
    with pytest.raises(ValueError):
        make_request("r", 10, spans=[ImageSpan(2, 4, "a"), ImageSpan(4, 2, "b")])   # overlap
    with pytest.raises(ValueError):
        make_request("r", 0)
    r = make_request("r", 5)
    r.output_token_ids.append(9)
    assert r.all_token_ids == [100, 101, 102, 103, 104, 9]
    assert (r.num_tokens, r.num_prompt_tokens, r.is_prefill) == (6, 5, True)
    r.num_computed_tokens = 5
    assert not r.is_prefill


def test_scheduler_config_validation():
    with pytest.raises(ValueError, match="max_num_seqs"):
        make_scheduler(max_num_seqs=0)
    with pytest.raises(ValueError, match="local_encode_tokens"):
        make_scheduler(aggregated=True)
    with pytest.raises(ValueError, match="local_encode_tokens"):
        make_scheduler(local_encode_tokens=8)
    s = make_scheduler(num_blocks=4, block_size=4, encoder_cache_tokens=8)
    with pytest.raises(ValueError, match="KV blocks"):
        s.add_request(make_request("big", 16, max_tokens=1))
    with pytest.raises(ValueError, match="encoder_cache_tokens"):
        s.add_request(make_request("img", 10, spans=[ImageSpan(0, 9, "k")]))
    s.add_request(make_request("ok", 4))
    with pytest.raises(ValueError, match="already"):
        s.add_request(make_request("ok", 4))


# ------------------------------------------------------------- encoder cache


def test_encoder_cache_ledger():
    cache = EncoderCache(capacity_tokens=10)
    cache.add_user("a", "r1")
    cache.add_user("a", "r2")
    assert cache.admit("a", 6, "A") and cache.used_tokens == 6
    assert cache.admit("a", 6, "other") and cache.get("a") == "A"    # re-admit: no-op True
    with pytest.raises(ValueError):
        cache.admit("a", 5)                                          # token count mismatch
    assert not cache.admit("b", 5, "B") and cache.used_tokens == 6   # does not fit
    assert cache.admit("c", 4, "C")                                  # nobody needs c
    assert cache.free_unused() == ["c"] and cache.used_tokens == 6
    cache.release_user("a", "r1")
    assert cache.contains("a")                                       # r2 still needs it
    cache.release_user("a", "r2")
    assert not cache.contains("a") and cache.used_tokens == 0
    with pytest.raises(KeyError):
        cache.release_user("a", "r2")
    assert cache.drain_freed() == ["c", "a"] and cache.drain_freed() == []
    # A key freed and admitted again before the drain is not reported as freed.
    cache.admit("d", 2)
    cache.free_unused()
    cache.admit("d", 2)
    cache.set_payload("d", "D")
    assert cache.drain_freed() == [] and cache.get("d") == "D"


# --------------------------------------------------------- images and yields


def test_running_request_with_pending_image_sits_out_and_keeps_its_place():
    s = make_scheduler()
    span = ImageSpan(8, 8, "img")
    s.add_request(make_request("A", 20, spans=[span]))
    s.add_request(make_request("B", 4))
    plan, _ = step(s)
    assert chunk_map(plan) == {"A": (0, 8), "B": (0, 4)}     # A's text before the image runs
    plan, _ = step(s)
    assert chunk_map(plan) == {"B": (4, 1)}
    assert plan.yielded == ["A"] and s.stats["yields_total"] == 1
    assert running_ids(s) == ["A", "B"] and waiting_ids(s) == []
    assert s.encoder_cache.admit("img", 8, "E")
    plan, _ = step(s)
    assert plan.chunks[0] == Chunk("A", 8, 12, (span,), sample=True)
    assert plan.yielded == []


def test_waiting_request_with_pending_image_moves_to_the_back():
    s = make_scheduler(max_num_seqs=1)
    s.add_request(make_request("A", 10, spans=[ImageSpan(0, 4, "img")]))
    s.add_request(make_request("B", 6))
    s.add_request(make_request("C", 6))
    plan, _ = step(s)
    assert chunk_map(plan) == {"B": (0, 6)}
    assert plan.yielded == ["A"]
    assert running_ids(s) == ["B"] and waiting_ids(s) == ["C", "A"]


def test_text_request_behind_pending_image_is_scheduled_in_the_same_step():
    s = make_scheduler()
    s.add_request(make_request("A", 10, spans=[ImageSpan(0, 4, "img")]))
    s.add_request(make_request("B", 6))
    plan = s.schedule()
    assert plan.chunks == [Chunk("B", 0, 6, (), sample=True)]
    assert plan.yielded == ["A"] and plan.num_batched_tokens == 6
    assert waiting_ids(s) == ["A"] and running_ids(s) == ["B"]


def test_chunk_stops_right_before_a_pending_image():
    s = make_scheduler()
    span = ImageSpan(10, 16, "img")
    s.add_request(make_request("A", 30, spans=[span]))
    plan, _ = step(s)
    assert plan.chunks == [Chunk("A", 0, 10, (), sample=False)]
    assert s.get_request("A").num_computed_tokens == 10 and s.get_request("A").output_token_ids == []
    plan, _ = step(s)
    assert plan.chunks == [] and plan.yielded == ["A"]
    s.encoder_cache.admit("img", 16, "E")
    plan, _ = step(s)
    assert plan.chunks == [Chunk("A", 10, 20, (span,), sample=True)]
    assert s.get_request("A").output_token_ids == [7]


def test_chunked_prefill_across_a_local_image_span():
    s = make_scheduler(max_num_batched_tokens=8)
    span = ImageSpan(4, 12, "img")
    s.add_request(make_request("A", 24, spans=[span]))
    s.encoder_cache.admit("img", 12, "E")
    plan, _ = step(s)
    assert plan.chunks == [Chunk("A", 0, 8, (span,))]
    assert s.encoder_cache.contains("img")
    plan, _ = step(s)
    assert plan.chunks == [Chunk("A", 8, 8, (span,))]
    assert not s.encoder_cache.contains("img")          # consumed at token 16
    assert s.encoder_cache.drain_freed() == ["img"]
    plan, _ = step(s)
    assert plan.chunks == [Chunk("A", 16, 8, (), sample=True)]


def test_shared_entry_freed_only_after_both_requests_consumed_it():
    s = make_scheduler(max_num_batched_tokens=10)
    s.add_request(make_request("A", 12, max_tokens=8, spans=[ImageSpan(0, 8, "K")]))
    s.add_request(make_request("B", 16, max_tokens=8, spans=[ImageSpan(4, 8, "K")]))
    s.encoder_cache.admit("K", 8, "E")
    assert s.encoder_cache.users("K") == {"A", "B"}
    plan, _ = step(s)
    assert chunk_map(plan) == {"A": (0, 10)}             # A passed its span end (8)
    assert s.encoder_cache.users("K") == {"B"} and s.encoder_cache.contains("K")
    plan, _ = step(s)
    assert chunk_map(plan) == {"A": (10, 2), "B": (0, 8)}   # B stops at 8 < 12
    assert s.encoder_cache.contains("K")
    plan = s.schedule()
    assert chunk_map(plan) == {"A": (12, 1), "B": (8, 8)}
    assert s.encoder_cache.contains("K")                 # planned, not yet consumed
    s.update(plan, {"A": 7, "B": 7})
    assert not s.encoder_cache.contains("K") and s.encoder_cache.used_tokens == 0
    assert s.encoder_cache.drain_freed() == ["K"]


# --------------------------------------------------------------- preemption


def test_preemption_refunds_the_tail_request():
    s = make_scheduler(block_size=4, num_blocks=7)
    for rid in "ABC":
        s.add_request(make_request(rid, 8, max_tokens=8))
    step(s)
    assert s.block_pool.num_used == 6
    s.add_request(make_request("D", 4))
    plan, _ = step(s)
    # A takes the last free block; B needs one too, so C (the tail) is preempted.
    assert chunk_map(plan) == {"A": (8, 1), "B": (8, 1)}
    assert plan.preempted == ["C"] and s.stats["preemptions_total"] == 1
    c = s.get_request("C")
    assert c.block_ids == [] and c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert c.status is RequestStatus.WAITING and c.output_token_ids == [7]
    assert waiting_ids(s) == ["C", "D"]                  # front of the queue; nobody admitted
    assert running_ids(s) == ["A", "B"]
    assert s.block_pool.num_used == 6 and s.block_pool.num_free == 1


def test_request_that_is_the_tail_preempts_itself():
    s = make_scheduler(block_size=4, num_blocks=5)
    s.add_request(make_request("A", 8, max_tokens=8))
    s.add_request(make_request("B", 8, max_tokens=8))
    step(s)
    plan, _ = step(s)
    assert chunk_map(plan) == {"A": (8, 1)} and plan.preempted == ["B"]
    assert s.block_pool.num_used == 3 and waiting_ids(s) == ["B"]
    # B recomputes prompt + its output token, then samples a new one.
    s.finish("A", RequestStatus.FINISHED_STOPPED)
    plan, _ = step(s)
    assert plan.chunks == [Chunk("B", 0, 9, (), sample=True)]
    assert s.get_request("B").output_token_ids == [7, 7]


def test_failed_admission_leaves_the_pool_unchanged_and_stops_admitting():
    s = make_scheduler(block_size=4, num_blocks=4)
    s.add_request(make_request("A", 7))
    step(s)                                # A holds 2 blocks; its decode fits in them
    used, free = s.block_pool.num_used, s.block_pool.num_free
    s.add_request(make_request("B", 12))   # needs 3 blocks, 2 free
    s.add_request(make_request("C", 4))    # would fit, but does not jump the queue
    plan = s.schedule()
    assert chunk_map(plan) == {"A": (7, 1)}
    assert (s.block_pool.num_used, s.block_pool.num_free) == (used, free)
    assert s.get_request("B").block_ids == [] and waiting_ids(s) == ["B", "C"]
    assert plan.preempted == []


def test_preempted_request_keeps_cached_images_and_refetches_consumed_ones():
    s = make_scheduler(block_size=4, num_blocks=8, max_num_batched_tokens=8)
    s.add_request(make_request("A", 20, max_tokens=8))
    s.add_request(make_request("B", 16, max_tokens=4,
                               spans=[ImageSpan(0, 4, "x"), ImageSpan(8, 4, "y")]))
    s.encoder_cache.admit("x", 4, "X")
    s.encoder_cache.admit("y", 4, "Y")
    step(s)                                  # A [0, 8)
    step(s)                                  # A [8, 16)
    plan, _ = step(s)                        # A [16, 20) + B [0, 4): B consumed x
    assert chunk_map(plan) == {"A": (16, 4), "B": (0, 4)}
    assert not s.encoder_cache.contains("x") and s.encoder_cache.contains("y")
    plan, _ = step(s)                        # A decode (block 6), B [4, 11) needs 2 more: preempted
    assert plan.preempted == ["B"] and chunk_map(plan) == {"A": (20, 1)}
    assert plan.refetch_keys == ["x"]        # consumed and gone; y is still cached
    assert s.encoder_cache.contains("y") and s.encoder_cache.users("y") == {"B"}
    assert s.encoder_cache.users("x") == {"B"}   # waiting for the refetched embedding


# ----------------------------------------------------------------- aborting


def test_abort_frees_everything_for_running_waiting_and_preempted_requests():
    s = make_scheduler(block_size=4, num_blocks=5)
    s.add_request(make_request("A", 8, max_tokens=8, spans=[ImageSpan(0, 4, "a")]))
    s.add_request(make_request("B", 8, max_tokens=8, spans=[ImageSpan(6, 2, "b")]))
    s.encoder_cache.admit("a", 4)
    s.encoder_cache.admit("b", 2)
    step(s)
    plan, _ = step(s)
    assert plan.preempted == ["B"]
    s.add_request(make_request("W", 8, spans=[ImageSpan(0, 4, "w")]))
    assert s.encoder_cache.users("b") == {"B"} and s.encoder_cache.users("w") == {"W"}
    assert s.abort("B") and s.abort("W") and s.abort("A")
    assert not s.abort("A")
    assert s.num_waiting == 0 and s.num_running == 0 and not s.has_unfinished()
    assert s.block_pool.num_used == 0 and s.block_pool.num_free == 5
    assert s.encoder_cache.num_users_total() == 0 and s.encoder_cache.used_tokens == 0
    assert s.encoder_cache.admit("w", 4)   # a late arrival for an aborted request...
    s.schedule()
    assert len(s.encoder_cache) == 0       # ...is freed by the next step


# ------------------------------------------------------------ stop conditions


def run_scripted(request: Request, tokens: list[int]):
    s = make_scheduler()
    s.add_request(request)
    for token in tokens:
        _, finished = step(s, token)
        if finished:
            return finished[0]
    return None


def test_stop_max_tokens():
    done = run_scripted(make_request("r", 4, max_tokens=3, eos=[2]), [5, 5, 5, 5])
    assert done.status is RequestStatus.FINISHED_LENGTH and done.finish_reason == "length"
    assert done.output_token_ids == (5, 5, 5)


def test_stop_eos_is_kept_in_the_output():
    done = run_scripted(make_request("r", 4, max_tokens=8, eos=[2]), [5, 2, 5])
    assert done.status is RequestStatus.FINISHED_STOPPED and done.output_token_ids == (5, 2)


def test_ignore_eos_runs_to_max_tokens():
    done = run_scripted(make_request("r", 4, max_tokens=3, eos=[2], ignore_eos=True), [2, 2, 2])
    assert done.status is RequestStatus.FINISHED_LENGTH and done.output_token_ids == (2, 2, 2)


def test_min_tokens_defers_eos_and_stop_tokens():
    done = run_scripted(make_request("r", 4, max_tokens=8, eos=[2], min_tokens=3,
                                     stop_token_ids=(9,)), [2, 9, 2])
    assert done.status is RequestStatus.FINISHED_STOPPED and done.output_token_ids == (2, 9, 2)


def test_stop_token_ids_even_with_ignore_eos():
    done = run_scripted(make_request("r", 4, max_tokens=8, eos=[2], ignore_eos=True,
                                     stop_token_ids=(9,)), [2, 9])
    assert done.status is RequestStatus.FINISHED_STOPPED and done.output_token_ids == (2, 9)


def test_finish_from_outside_frees_the_request():
    s = make_scheduler()
    s.add_request(make_request("r", 4, max_tokens=8))
    step(s)
    done = s.finish("r", RequestStatus.FINISHED_STOPPED)
    assert done.finish_reason == "stop" and done.output_token_ids == (7,)
    assert s.block_pool.num_used == 0 and s.num_running == 0
    with pytest.raises(ValueError):
        s.finish("x", RequestStatus.RUNNING)
