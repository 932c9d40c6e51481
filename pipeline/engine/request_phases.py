"""Where one request's time went in its generator, as vLLM reports it:
queued (arrival to its first scheduled step: waiting for a slot, KV blocks
or its images' embeddings), prefill (to its first token), decode (to its
last). Monotonic seconds; the generator's proxy turns them into
vllm:request_queue_time_seconds and its siblings, and a log line."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class RequestPhases:
    arrived: float = field(default_factory=time.monotonic)
    scheduled: float | None = None
    first_token: float | None = None

    def on_scheduled(self, now: float) -> None:
        if self.scheduled is None:   # the first time only: a preempted request's later waits are not queueing
            self.scheduled = now

    def on_token(self, now: float) -> None:
        if self.first_token is None:
            self.first_token = now

    def durations(self, now: float) -> tuple[float, float, float]:
        """(queue, prefill, decode) seconds, at its end `now`."""
        scheduled = self.scheduled if self.scheduled is not None else now
        first = self.first_token if self.first_token is not None else now
        return scheduled - self.arrived, first - scheduled, now - first
