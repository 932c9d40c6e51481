"""Decode ahead (engine/ahead.py) on the CPU's fast decode path: a step
launched before the last one's tokens are read gives exactly the outputs
of the engine that waits, for every sampling option, with arrivals, aborts
and KV pressure in between, and leaves nothing allocated."""

from __future__ import annotations

import json
import random

import pytest
import torch

from pipeline.engine.engine import Engine, EngineConfig
from pipeline.engine.step_profile import StepProfile
from pipeline.sampling_params import SamplingParams
from test_engine import make_request, offline, run_engine, tiny  # noqa: F401  (the fixture)

PENALTIES = dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.4, logit_bias=((11, 3.0),))
SCHEMA = {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"enum": ["x", "yy"]}},
          "required": ["a", "b"], "additionalProperties": False}   # bounded: a random model ends it


def engine_for(tiny, ahead: bool, **config) -> Engine:  # noqa: F811
    model, processor = tiny
    settings = dict(max_num_batched_tokens=96, max_num_seqs=8, block_size=8, kv_cache_bytes=4 << 20,
                    fast_decode=True, fast_mixed=False, decode_ahead=ahead)
    return Engine(model, processor.tokenizer, EngineConfig(**{**settings, **config}), torch.device("cpu"))


def drain(engine: Engine, arrivals: dict, aborts: dict | None = None) -> dict:
    """Run until done; arrivals: step -> [(id, prompt, params)]. -> id ->
    (tokens, text, finish reason, logprobs)."""
    got: dict = {}
    step = 0
    while step <= max(arrivals) or engine.has_work():
        for rid, prompt, params in arrivals.get(step, []):
            engine.add_request(rid, prompt, [], params)
        for rid in (aborts or {}).get(step, []):
            engine.abort(rid)
        for out in engine.step():
            tokens, text, _, logprobs = got.get(out.request_id, ((), "", None, ()))
            got[out.request_id] = (tokens + out.new_token_ids, text + out.new_text, out.finish_reason,
                                   logprobs + out.logprobs)
        step += 1
        assert step < 2000
    return got


def same_outputs(got: dict, want: dict) -> bool:
    """Equal tokens, text and finish reasons; logprobs equal within 1e-4 (a
    batch that still holds a row of a request that just ended rounds
    differently in the last float bits)."""
    if got.keys() != want.keys():
        return False
    for rid, (tokens, text, reason, logprobs) in got.items():
        w_tokens, w_text, w_reason, w_logprobs = want[rid]
        if (tokens, text, reason) != (w_tokens, w_text, w_reason) or len(logprobs) != len(w_logprobs):
            return False
        for (chosen, ids, top), (w_chosen, w_ids, w_top) in zip(logprobs, w_logprobs):
            if ids != w_ids or abs(chosen - w_chosen) > 1e-4 or any(abs(a - b) > 1e-4 for a, b in zip(top, w_top)):
                return False
    return True


def test_batched_greedy_requests_equal_each_run_alone_and_the_steps_ran_ahead(tiny):  # noqa: F811
    model, processor = tiny
    requests = {f"r{i}": make_request(processor, i, 0) for i in range(6)}
    expected = {rid: offline(model, p, inp, 12) for rid, (p, _, inp) in requests.items()}
    engine = engine_for(tiny, ahead=True)
    # Arrivals while others decode: the engine reads the step in flight, prefills, then runs ahead again.
    outputs, finished = run_engine(engine, model, requests, {0: ["r0", "r1"], 4: ["r2"], 9: ["r3", "r4"], 15: ["r5"]},
                                   {})
    assert outputs == expected and set(finished.values()) == {"length"}
    assert engine.counters()["decode_ahead_steps"] >= 10
    assert engine.scheduler.block_pool.num_used == 0 and not engine.live and not engine.has_work()
    assert engine.ahead.launched is None


def test_every_sampling_option_gives_what_the_waiting_engine_gives(tiny):  # noqa: F811
    _, processor = tiny
    prompts = [make_request(processor, 40 + i, 0)[0] for i in range(8)]
    first = engine_for(tiny, ahead=False)
    greedy = drain(first, {0: [("g", prompts[0], SamplingParams(max_tokens=12, ignore_eos=True))]})["g"]
    stop_id, stop_text = greedy[0][4], greedy[1][3:6]
    import llguidance

    json_grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA),
                                                                 overrides={"whitespace_flexible": False})
    params = {
        "penalties+logprobs": SamplingParams(max_tokens=14, ignore_eos=True, logprobs=3, **PENALTIES),
        "seeded": SamplingParams(max_tokens=14, ignore_eos=True, temperature=0.9, top_p=0.9, min_p=0.02, seed=5),
        "seeded+penalties": SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.2, seed=9, **PENALTIES),
        "stop-id": SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=[stop_id]),
        "min-tokens": SamplingParams(max_tokens=12, ignore_eos=True, min_tokens=8, stop_token_ids=[stop_id]),
        "stop-string": SamplingParams(max_tokens=12, ignore_eos=True, stop=[stop_text] if stop_text.strip() else []),
        "json": SamplingParams(max_tokens=60, grammar=json_grammar, logprobs=1),
        "short": SamplingParams(max_tokens=2, ignore_eos=True),
    }
    arrivals = {0: [], 3: []}
    for i, (rid, p) in enumerate(params.items()):
        # The stop options on the greedy request's prompt: its stop token and text come up.
        prompt = prompts[0] if rid.startswith(("stop", "min")) else prompts[i]
        arrivals[0 if i % 2 == 0 else 3].append((rid, prompt, p))
    waiting = drain(engine_for(tiny, ahead=False), arrivals)
    ahead_engine = engine_for(tiny, ahead=True)
    ahead = drain(ahead_engine, arrivals)
    assert same_outputs(ahead, waiting)
    assert ahead["stop-id"][2] == "stop" and ahead["stop-id"][0][-1] == stop_id
    assert stop_id not in ahead["min-tokens"][0][:8]
    assert json.loads(ahead["json"][1]).keys() == {"a", "b"} and ahead["json"][2] == "stop"
    assert len(ahead["penalties+logprobs"][3]) == 14
    assert ahead_engine.counters()["decode_ahead_steps"] > 5
    assert ahead_engine.scheduler.block_pool.num_used == 0 and not ahead_engine.live


@pytest.mark.parametrize("seed, caching", [(0, False), (1, False), (2, True)])
def test_aborts_arrivals_and_kv_pressure_leave_nothing_behind(tiny, seed, caching):  # noqa: F811
    """Random arrivals and aborts, a KV cache too small for everyone (the
    engine must not plan ahead into a preemption): the same outputs as the
    waiting engine for every request that was not aborted, nothing left.
    With prefix caching, prompts repeat: requests that end or are aborted
    with a step in flight leave their blocks named for the later ones."""
    _, processor = tiny
    rng = random.Random(seed)
    prompts = 6 if caching else 24
    arrivals, aborts = {}, {}
    for i in range(24):
        step = rng.randrange(60)
        params = SamplingParams(max_tokens=rng.randint(1, 10), ignore_eos=True,
                                **(PENALTIES if rng.random() < 0.3 else {}))
        prompt = make_request(processor, 100 + i % prompts, 0)[0]
        arrivals.setdefault(step, []).append((f"q{i}", prompt, params))
        if rng.random() < 0.25:
            aborts.setdefault(step + rng.randrange(1, 8), []).append(f"q{i}")
    tight = dict(kv_cache_bytes=96 << 10, max_num_seqs=6, prefix_caching=caching)
    waiting = drain(engine_for(tiny, ahead=False, **tight), arrivals, aborts)
    engine = engine_for(tiny, ahead=True, **tight)
    ahead = drain(engine, arrivals, aborts)
    aborted = {rid for ids in aborts.values() for rid in ids}
    for rid in {rid for ids in arrivals.values() for rid, _, _ in ids} - aborted:
        assert same_outputs({rid: ahead[rid]}, {rid: waiting[rid]}), rid
    assert engine.scheduler.block_pool.num_used == 0 and not engine.live and not engine.has_work()
    assert engine.counters()["decode_ahead_steps"] > 0
    assert (engine.scheduler.prefix.hits > 0) if caching else engine.scheduler.prefix is None


def test_an_abort_between_steps_leaves_the_others_their_own_tokens(tiny):  # noqa: F811
    """The middle request of a decode batch in flight is aborted: the next
    step's rows take their input tokens from the right rows of the last."""
    model, processor = tiny
    requests = {f"m{i}": make_request(processor, 60 + i, 0) for i in range(3)}
    expected = {rid: offline(model, p, inp, 12) for rid, (p, _, inp) in requests.items()}
    engine = engine_for(tiny, ahead=True)
    outputs, finished = run_engine(engine, model, requests, {0: list(requests)}, {}, aborts={5: ["m1"]})
    assert finished["m1"] == "abort" and expected["m1"][:len(outputs.get("m1", []))] == outputs.get("m1", [])
    assert {rid: outputs[rid] for rid in ("m0", "m2")} == {rid: expected[rid] for rid in ("m0", "m2")}
    assert engine.scheduler.block_pool.num_used == 0 and not engine.live and not engine.has_work()


def test_the_wait_for_a_step_read_late_is_in_its_kinds_time(tiny):  # noqa: F811
    """An arrival makes the engine read the step in flight before it plans a
    prefill; that wait is the launched decode step's time, not idle time."""
    model, processor = tiny
    requests = {f"r{i}": make_request(processor, i, 0) for i in range(3)}
    engine = engine_for(tiny, ahead=True)
    waits = []
    add_wait = engine.profile.add_wait
    engine.profile.add_wait = lambda kind, seconds: (waits.append((kind, seconds)), add_wait(kind, seconds))
    run_engine(engine, model, requests, {0: ["r0"], 5: ["r1"], 9: ["r2"]}, {})
    assert waits and {kind for kind, _ in waits} == {"decode"} and all(s >= 0 for _, s in waits)
    # The decode kind's running time holds the waits on top of its steps' own phases.
    assert engine.profile.counters()["step_us.decode"] >= int(sum(s for _, s in waits) * 1e6)


def test_a_window_that_holds_only_a_wait_reports_no_steps():
    profile = StepProfile()
    profile.add_wait("decode", 0.25)
    got = profile.window()["decode"]
    assert got["steps"] == 0 and got["update_ms"] == 250.0 and got["busy"] > 0
    assert profile.counters() == {"steps.decode": 0, "step_tokens.decode": 0, "step_us.decode": 250000}
