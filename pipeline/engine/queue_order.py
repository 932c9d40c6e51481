"""Where a request goes in the scheduler's queues: vLLM's scheduling
policies (--scheduling-policy).

- fcfs (the default): arrival order; a preempted request is first in line
  again, and the running list's tail, the latest admitted, is preempted
  first.
- priority: by (priority, arrival), a lower priority value first, as
  vLLM's. Both queues are kept in that order, so the waiting queue's head
  is the most urgent request and the running list's tail, the first
  preempted when blocks run short, the least urgent. As in vLLM, a
  waiting request never preempts a running one to get in. A waiting
  request that sits out a step for its image (the scheduler moves it to
  the back, so that the ones behind it go first) takes its place again
  after the step.
"""

from __future__ import annotations

import bisect
from collections import deque

from pipeline.engine.request import Request

POLICIES = ("fcfs", "priority")


def urgency(request: Request) -> tuple[int, int]:
    return request.priority, request.arrival


def enqueue(waiting: deque[Request], request: Request, policy: str, preempted: bool = False) -> None:
    if policy == "fcfs":
        if preempted:
            waiting.appendleft(request)
        else:
            waiting.append(request)
        return
    key = urgency(request)
    at = next((i for i, other in enumerate(waiting) if urgency(other) > key), len(waiting))
    waiting.insert(at, request)


def admit(running: list[Request], request: Request, policy: str) -> None:
    if policy == "fcfs":
        running.append(request)
    else:
        bisect.insort(running, request, key=urgency)


def settle(waiting: deque[Request], policy: str) -> None:
    """After a step's admissions: the priority order again (the scheduler
    moved requests waiting for their images to the back)."""
    if policy == "priority" and any(urgency(a) > urgency(b) for a, b in zip(waiting, list(waiting)[1:])):
        ordered = sorted(waiting, key=urgency)
        waiting.clear()
        waiting.extend(ordered)
