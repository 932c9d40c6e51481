"""Prefill pacing (engine/pacing.py): the pacer's arithmetic on a hand-made
clock, the scheduler's decode-only plans, and the engine with pacing on
giving the same greedy tokens as without, with prefill held and decode
ahead running through the held steps."""

from __future__ import annotations

import pytest
import torch

from pipeline.engine.engine import Engine, EngineConfig
from pipeline.engine.pacing import PrefillPacer
from scheduler_helpers import chunk_map, make_request as sched_request, make_scheduler, running_ids, step
from test_engine import make_request, offline, run_engine, tiny  # noqa: F401  (the fixture)

MS = 1e-3


def steady(pacer: PrefillPacer, every_ms: float, count: int, start: float = 0.0) -> float:
    """`count` decode steps' tokens, `every_ms` apart; returns the last time."""
    now = start
    for i in range(count):
        now = start + i * every_ms * MS
        pacer.on_tokens(now, mixed=False)
    return now


def test_prefill_is_allowed_while_the_projected_mean_stays_within_the_target():
    pacer = PrefillPacer(10 * MS, max_hold_s=1.0, window=8)
    pacer.on_tokens(0.0, mixed=False)
    pacer.on_tokens(30 * MS, mixed=True)            # a mixed step of 30 ms
    now = steady(pacer, 4, 6, start=34 * MS)         # 8 times now: 0, 30, 34, ..., 54 ms
    # The next step counted as 30 ms: (54 - 0 + 30) / 8 = 10.5 ms > 10.
    assert not pacer.allows_prefill(now)
    assert pacer.held_steps == 1
    pacer.on_tokens(now + 4 * MS, mixed=False)       # the window drops t=0: (58 - 30 + 30) / 8 = 7.25 ms
    assert pacer.allows_prefill(now + 4 * MS)
    assert pacer.held_steps == 1


def test_a_hold_ends_after_max_hold_even_if_the_target_is_out_of_reach():
    pacer = PrefillPacer(1 * MS, max_hold_s=0.02, window=4)
    now = steady(pacer, 5, 4)                        # decode steps alone at 5 ms: over the 1 ms target
    assert not pacer.allows_prefill(now)             # the hold starts
    now = steady(pacer, 5, 2, start=now + 5 * MS)    # 10 ms later, still held
    assert not pacer.allows_prefill(now)
    assert pacer.allows_prefill(now + 10 * MS)       # 20 ms held: released for one step
    assert not pacer.allows_prefill(now + 11 * MS)   # and a new hold starts
    assert pacer.held_steps == 3


def test_no_decodes_clears_the_window_and_off_always_allows():
    pacer = PrefillPacer(10 * MS, window=4)
    pacer.on_tokens(0.0, mixed=False)
    pacer.on_tokens(1.0, mixed=False)                # a second's gap: nobody was decoding
    pacer.on_no_decodes()
    assert pacer.allows_prefill(1.0)                 # fewer than 2 times: nothing to project
    off = PrefillPacer(None)
    steady(off, 100, 10)
    assert not off.enabled and off.allows_prefill(1.0) and off.held_steps == 0


@pytest.mark.parametrize("kwargs", [dict(target_s=0.0), dict(target_s=-1.0), dict(target_s=0.01, max_hold_s=-1),
                                    dict(target_s=0.01, window=1)])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        PrefillPacer(**kwargs)


def test_a_decode_only_plan_leaves_prefill_for_later():
    s = make_scheduler(max_num_batched_tokens=16)
    s.add_request(sched_request("a", 6, max_tokens=8))
    step(s)                                          # a: prefilled, one token out
    s.add_request(sched_request("b", 40))            # b: prefilled 15 of 40 in the next step
    step(s)
    s.add_request(sched_request("c", 5))             # c: waits
    assert s.prefill_due() and s.any_decoding()
    assert s.can_decode_ahead({"a"}, prefill=False) and not s.can_decode_ahead({"a"})
    plan = s.schedule(prefill=False)
    assert chunk_map(plan) == {"a": (7, 1)} and not plan.yielded
    assert running_ids(s) == ["a", "b"] and [r.request_id for r in s.waiting] == ["c"]
    s.update(plan, {"a": 7})
    plan = s.schedule()                              # prefill again: b's next chunk fills the budget
    assert chunk_map(plan) == {"a": (8, 1), "b": (15, 15)}


def test_pacing_gives_the_same_greedy_tokens_and_holds_prefill_during_decode_ahead(tiny):  # noqa: F811
    model, processor = tiny
    requests = {f"r{i}": make_request(processor, i, 0) for i in range(6)}
    expected = {rid: offline(model, p, inp, 12) for rid, (p, _, inp) in requests.items()}
    # An unreachable target: every prefill due is held, each hold released after 0 s (every other step).
    config = EngineConfig(max_num_batched_tokens=96, max_num_seqs=8, block_size=8, kv_cache_bytes=4 << 20,
                          fast_decode=True, fast_mixed=False, decode_ahead=True, prefill_pacing_ms=1e-6,
                          prefill_pacing_max_hold_ms=0.0)
    engine = Engine(model, processor.tokenizer, config, torch.device("cpu"))
    outputs, finished = run_engine(engine, model, requests, {0: ["r0", "r1"], 4: ["r2"], 9: ["r3", "r4"], 15: ["r5"]},
                                   {})
    assert outputs == expected and set(finished.values()) == {"length"}
    counters = engine.counters()
    assert counters["prefill_held_steps"] >= 3 and counters["decode_ahead_steps"] >= 10
    assert engine.scheduler.block_pool.num_used == 0 and not engine.live and not engine.has_work()
    assert engine.ahead.launched is None
