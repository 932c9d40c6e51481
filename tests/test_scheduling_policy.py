"""vLLM's --scheduling-policy in the scheduler: fcfs takes requests in
arrival order; priority by (priority, arrival), lower first, preempts the
least urgent running request when blocks run short (not the latest one
admitted), keeps its order over requests that sit out a step for their
image, and never preempts to admit; and the flag reaches the generators and
the proxy from epd-launch, where a priority without it is a 400."""

from __future__ import annotations

import asyncio
import json

import pytest

from pipeline.engine.request import ImageSpan, RequestStatus
from scheduler_helpers import chunk_map, make_request, make_scheduler, running_ids, step, waiting_ids
from test_engine import tiny  # noqa: F401 (the module fixture)


def prioritised(rid: str, priority: int, arrival: int, prompt_len: int = 4, **kw):
    request = make_request(rid, prompt_len, **kw)
    request.priority, request.arrival = priority, arrival
    return request


@pytest.mark.parametrize("policy, order", [("fcfs", "ABC"), ("priority", "BAC")])
def test_one_seat_goes_by_the_policy(policy, order):
    s = make_scheduler(max_num_seqs=1, policy=policy)
    for rid, priority, arrival in (("A", 5, 0), ("B", 0, 1), ("C", 5, 2)):
        s.add_request(prioritised(rid, priority, arrival, max_tokens=1))
    served = []
    while s.has_unfinished():
        plan, finished = step(s)
        served += [f.request_id for f in finished]
    assert "".join(served) == order


def test_the_least_urgent_running_request_is_preempted_first():
    s = make_scheduler(block_size=4, num_blocks=7, policy="priority")
    s.add_request(prioritised("B", 9, 0, prompt_len=8, max_tokens=8))
    step(s)   # B runs alone first: the latest admitted will not be the least urgent
    for rid, priority, arrival in (("A", 1, 1), ("C", 0, 2)):
        s.add_request(prioritised(rid, priority, arrival, prompt_len=8, max_tokens=8))
    step(s)
    assert running_ids(s) == ["C", "A", "B"] and s.block_pool.num_free == 0
    plan, _ = step(s)
    # A and C need a block and none is free: B, the least urgent, goes (fcfs would take C, the last admitted).
    assert plan.preempted == ["B"] and set(chunk_map(plan)) == {"A", "C"}
    assert s.get_request("B").status is RequestStatus.WAITING and waiting_ids(s) == ["B"]
    s.add_request(prioritised("D", 0, 3))
    assert waiting_ids(s) == ["D", "B"]   # a more urgent arrival goes before the preempted one


def test_a_request_waiting_for_its_image_keeps_its_place():
    s = make_scheduler(max_num_seqs=2, policy="priority")
    blocked = prioritised("A", 0, 0, prompt_len=8, spans=(ImageSpan(0, 4, "missing-image"),))
    s.add_request(blocked)
    s.add_request(prioritised("B", 3, 1))
    s.add_request(prioritised("C", 4, 2))
    s.add_request(prioritised("D", 5, 3))
    plan, _ = step(s)
    assert set(chunk_map(plan)) == {"B", "C"}   # A sits the step out for its image
    assert waiting_ids(s) == ["A", "D"]


def test_the_engine_takes_a_requests_priority(tiny):
    import torch

    from pipeline.engine.engine import Engine, EngineConfig
    from pipeline.processing.processor import MultimodalPrompt
    from pipeline.sampling_params import SamplingParams

    model, processor = tiny
    engine = Engine(model, processor.tokenizer, EngineConfig(max_num_seqs=1, scheduling_policy="priority"),
                    torch.device("cpu"))
    for rid, priority in (("late", 3), ("urgent", -1), ("normal", 0)):
        engine.add_request(rid, MultimodalPrompt([5, 6, 7], [], []), [], SamplingParams(max_tokens=2), priority=priority)
    done = []
    while engine.has_work():
        done += [out.request_id for out in engine.step() if out.finished]
    assert done == ["urgent", "normal", "late"]


def test_the_flag_reaches_both_stages_and_a_priority_needs_it(tiny_dir):
    import pipeline.launch.cli as cli
    import pipeline.proxy.api_types as api
    from pipeline.launch.plan import HostFacts, plan_stages
    from pipeline.processing.processor import Processor
    from pipeline.proxy.requests import ModelInfo, completion_work

    args = cli.parse_args([str(tiny_dir), "--device", "cpu", "--scheduling-policy", "priority"])
    specs = plan_stages(cli.build_options(args), HostFacts(gpu_count=0))
    for role in ("generator", "proxy"):
        assert "--scheduling-policy=priority" in next(s for s in specs if s.role == role).args
    processor = Processor.from_checkpoint(tiny_dir, image_token_id=0)

    def priority_of(policy: str, **fields) -> int:
        model = ModelInfo("tiny", processor, 512, b"salt", scheduling_policy=policy)
        req = api.parse_body(json.dumps({"prompt": "x", **fields}).encode(), "completion")
        return asyncio.run(completion_work(req, model, "r", "inproc://proxy", req.prompt)).request.priority

    assert priority_of("priority", priority=-3) == -3 and priority_of("fcfs") == 0
    with pytest.raises(api.ApiError, match="--scheduling-policy priority") as caught:
        priority_of("fcfs", priority=2)
    assert caught.value.param == "priority" and caught.value.status == 400
