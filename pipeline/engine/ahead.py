"""Decode ahead: the next decode step is planned and launched before the
last one's tokens are read, so the host's work of a step (reading the
tokens, the stop checks and outputs, the grammar matchers, the next plan
and its inputs) runs while the device computes the next forward.

At batch 32 on the H200 a decode step was bound by the host: 3.3 ms of
device work in steps of 4.4 ms, and 5.5 ms with a JSON grammar, whose
matchers work on the host between the step's wait and the next launch
(docs/benchmarks.md, issue 17).

How a step goes, once a decode step N is in flight (its tokens on the
device, their copy to the host queued):
- the scheduler plans N+1 with N's tokens pending (Scheduler.advance put a
  PENDING_TOKEN in each request's output); only when it can do so without
  admitting, refetching or preempting anyone (Scheduler.can_decode_ahead),
  else N is read and the next step plans with every token known;
- N+1's forward is launched, its input tokens copied on the device from
  N's sampled tokens (DecodeGraphs.run's device_tokens);
- N is read: its tokens replace the pending ones, the requests they stop
  end, and N's outputs are made, exactly as a step that waited would;
- N+1's rows of requests that N ended are dropped; the grammar masks are
  filled (the matchers have N's tokens now), and N+1's choice is queued.
A request that ends at N thus costs one forward row more; its blocks were
planned for N+1 and go back when it ends, and the forward that writes them
is queued before anything that could reuse them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from pipeline.engine.choose import Drawn, queue_choice, read
from pipeline.engine.output import RequestOutput
from pipeline.engine.plan import Chunk, StepPlan
from pipeline.engine.request import RequestStatus
from pipeline.engine.small_copies import steady_tensor
from pipeline.engine.step_profile import step_kind


@dataclass
class Launched:
    """A decode step whose choice is queued and not read yet."""

    plan: StepPlan
    due: list[Chunk]
    drawn: Drawn


class DecodeAhead:
    """The engine's steps while a decode step is in flight (Engine.step
    hands over to step() then). It is given the engine on each call rather
    than holding it: a cycle would keep a dropped engine's KV cache and
    graphs alive until the garbage collector ran."""

    def __init__(self) -> None:
        self.launched: Launched | None = None
        self.steps = 0   # steps planned and launched ahead of the last one's read

    def launch(self, engine, plan: StepPlan, due: list[Chunk], logits: torch.Tensor, rows, masks) -> None:
        """Queue the choice of a decode step that just ran, instead of waiting for it."""
        self.launched = Launched(plan, due, queue_choice(logits, rows, engine.penalties, masks))
        engine.scheduler.advance(plan)

    def step(self, engine, prefill: bool = True) -> list[RequestOutput]:
        """The outputs of the step in flight, with the next one launched where
        it can be. prefill=False: the next step may only decode (engine/pacing.py)."""
        launched = self.launched
        self.launched = None
        t0 = time.perf_counter()
        if not engine.scheduler.can_decode_ahead({c.request_id for c in launched.due}, prefill):
            outputs = self._collect(engine, launched)   # the next step plans with every token known
            # The wait is the launched step's device time: count it as that
            # step's, not as idle time between steps.
            kind = step_kind(len(launched.plan.chunks), len(launched.plan.chunks), 0)
            engine.profile.add_wait(kind, time.perf_counter() - t0)
            return outputs
        plan = engine.scheduler.schedule(prefill)
        self.steps += 1
        t1 = time.perf_counter()
        due, logits = self._run(engine, plan, launched)
        t2 = time.perf_counter()
        outputs = self._collect(engine, launched)    # waits for N's tokens while N+1's forward runs
        keep = [i for i, chunk in enumerate(due) if _running(engine, chunk.request_id)]
        if keep:
            if len(keep) < len(due):
                logits = logits.index_select(0, steady_tensor("ahead_keep", tuple(keep), torch.long, logits.device))
                due = [due[i] for i in keep]
            grammars = engine.grammars_if_any()
            masks = grammars.fill([engine.live[c.request_id].matcher for c in due]) if grammars else None
            # Before advance(): min_tokens counts the tokens before this step, as a step that waited would.
            rows = [engine.sampling_row(c.request_id) for c in due]
            self.launched = Launched(plan, due, queue_choice(logits, rows, engine.penalties, masks))
        engine.scheduler.advance(plan)       # skips the requests N ended
        engine.profile.record(step_kind(len(plan.chunks), len(plan.chunks), 0),
                              {"schedule": t1 - t0, "forward": t2 - t1, "update": time.perf_counter() - t2},
                              len(plan.chunks), len(plan.chunks))
        return outputs

    def _run(self, engine, plan: StepPlan, launched: Launched) -> tuple[list[Chunk], torch.Tensor]:
        """Launch N+1's forward, its input tokens taken from N's on the device."""
        row_of = {c.request_id: i for i, c in enumerate(launched.due)}
        order = tuple(row_of[c.request_id] for c in plan.chunks)
        tokens = launched.drawn.tokens
        if order != tuple(range(len(tokens))):
            tokens = tokens.index_select(0, steady_tensor("ahead_rows", order, torch.long, tokens.device))
        started = time.monotonic()
        for chunk in plan.chunks:
            engine.live[chunk.request_id].phases.on_scheduled(started)
        requests = {c.request_id: engine.scheduler.get_request(c.request_id) for c in plan.chunks}
        geometry = {c.request_id: engine.live[c.request_id].geometry for c in plan.chunks}
        return engine.runner.execute(plan, requests, geometry, engine.scheduler.encoder_cache.get, tokens)

    def _collect(self, engine, launched: Launched) -> list[RequestOutput]:
        """Read a launched step and apply it: what Engine.step does after its wait."""
        chosen = read(launched.drawn, engine.grammars_if_any())
        sampled = {c.request_id: token for c, token in zip(launched.due, chosen.tokens)}
        logprobs = {launched.due[i].request_id: lp for i, lp in chosen.logprobs.items()}
        finished = {f.request_id: f for f in engine.scheduler.resolve(sampled)}
        outputs = [engine.token_output(rid, token, finished.get(rid), logprobs.get(rid))
                   for rid, token in sampled.items() if rid in engine.live]   # not those aborted since
        engine.scheduler.encoder_cache.drain_freed()
        return outputs


def _running(engine, request_id: str) -> bool:
    request = engine.scheduler.get_request(request_id)
    return request is not None and request.status is RequestStatus.RUNNING and request_id in engine.live
