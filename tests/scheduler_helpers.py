"""Helpers for the scheduler's tests: a small scheduler, requests, and one
engine step with a sampler that returns a fixed token."""

from __future__ import annotations

from pipeline.engine.request import Request
from pipeline.sampling_params import SamplingParams
from pipeline.engine.scheduler import Scheduler, SchedulerConfig, StepPlan


def make_scheduler(**overrides) -> Scheduler:
    config = dict(max_num_batched_tokens=64, max_num_seqs=8, block_size=4, num_blocks=64,
                  encoder_cache_tokens=64)
    config.update(overrides)
    return Scheduler(SchedulerConfig(**config))


def make_request(rid: str, prompt_len: int, max_tokens: int = 4, spans=(), eos=(), **sampling) -> Request:
    return Request(rid, list(range(100, 100 + prompt_len)), tuple(spans),
                   SamplingParams(max_tokens=max_tokens, **sampling), eos_token_ids=tuple(eos))


def step(scheduler: Scheduler, token: int = 7):
    """One engine step with a sampler that returns `token` for every request due a sample."""
    plan = scheduler.schedule()
    sampled = {c.request_id: token for c in plan.chunks if c.sample}
    return plan, scheduler.update(plan, sampled)


def chunk_map(plan: StepPlan) -> dict[str, tuple[int, int]]:
    return {c.request_id: (c.start, c.num_tokens) for c in plan.chunks}


def waiting_ids(s: Scheduler) -> list[str]:
    return [r.request_id for r in s.waiting]


def running_ids(s: Scheduler) -> list[str]:
    return [r.request_id for r in s.running]
