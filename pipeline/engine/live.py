"""What the engine keeps of each request beside the scheduler's Request:
where its tokens sit, its text so far, its sampling state (a seeded
generator, a penalty row, a grammar matcher), the output it brought from
another generator, and what is still to be sent with its first token."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pipeline.engine.output import TextState
from pipeline.engine.prompt_logprobs import PromptLogprob
from pipeline.engine.request_phases import RequestPhases
from pipeline.engine.runner import PromptGeometry


@dataclass
class LiveRequest:
    """Engine-side state of one request."""

    geometry: PromptGeometry
    text: TextState
    generator: torch.Generator | None
    image_inputs: dict[str, tuple[torch.Tensor, tuple[int, int, int]]]
    pool_row: int | None = None   # in the engine's PenaltyPool, from the request's first sampled token on
    matcher: Any = None           # its grammar's matcher (structured output), if any
    earlier_output: tuple[int, ...] = ()   # tokens produced before a move here (Resumed), counted as output
    stop_token_ids: frozenset[int] = frozenset()   # asked for; they, not EOS, name a stop_reason
    phases: RequestPhases = field(default_factory=RequestPhases)
    # Asked for and not yet sent (with the first token): by position of the scored token.
    prompt_logprobs: dict[int, PromptLogprob] | None = None
