"""What the proxy keeps of a request it dispatched (Work: what it sends,
kept to send again; Flight: where it is and what came back), and the ids
its attempts have on the wire."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import msgspec

from pipeline import protocol
from pipeline.proxy.echo import Echo
from pipeline.proxy.reasoning import ReasoningSplit

ATTEMPT_MARK = "~"   # the request ids the proxy makes never contain it


def wire_id(request_id: str, attempt: int) -> str:
    """The id a request has on the wire in its `attempt`-th dispatch."""
    return request_id if attempt == 0 else f"{request_id}{ATTEMPT_MARK}{attempt}"


def parse_wire_id(wire: str) -> tuple[str, int]:
    request_id, mark, attempt = wire.rpartition(ATTEMPT_MARK)
    return (request_id, int(attempt)) if mark and attempt.isdigit() else (wire, 0)


@dataclass
class Work:
    """What the proxy sends for one request (kept to re-send it)."""

    request: protocol.GenerateRequest
    jobs: list[protocol.EncodeJob]   # consumer filled in at dispatch
    cost: int                        # prompt + max new tokens, for load balancing
    arrived: float | None = None     # time.monotonic() at the HTTP request's arrival (None: at submit)
    client_id: str = ""              # the request's X-Request-Id, for the log
    tokens_as_ids: bool = False      # vLLM's return_tokens_as_token_ids: logprobs name tokens by id
    prompt_logprobs: bool = False    # the response carries vLLM's prompt_logprobs
    echo: Echo | None = None         # what the answer repeats first (proxy/echo.py)
    reasoning: ReasoningSplit | None = None   # how a chat answer splits into reasoning and content
    choices: Choices | None = None   # the n copies of one request (fanout.py); None: n is 1
    return_token_ids: bool = False   # vLLM's: the answer carries token ids (proxy/token_ids.py)


class Choices:
    """The n choices of one request, for vLLM's per-request series
    (vllm:request_params_n, vllm:request_max_num_generation_tokens)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.left = n
        self.most_tokens = 0

    def ended(self, tokens: int) -> int | None:
        """One choice ended with `tokens`: the most any choice generated,
        once the last has ended (else None)."""
        self.left -= 1
        self.most_tokens = max(self.most_tokens, tokens)
        return self.most_tokens if self.left == 0 else None


@dataclass
class Flight:
    work: Work
    generator: str
    deltas: asyncio.Queue
    created: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    last_token_at: float | None = None
    # Seconds between tokens as deltas bring them (k tokens in one delta: k intervals of a k-th each).
    intervals: list[float] = field(default_factory=list)
    tokens: int = 0
    token_ids: list[int] = field(default_factory=list)   # generated so far
    resumed_from: int = 0      # tokens generated before the last move to another generator
    text_sent: int = 0         # characters of text the deltas brought (a moved request goes on from them)
    encoders: dict[str, list[str]] = field(default_factory=dict)   # job id -> encoders tried
    attempt: int = 0           # dispatches so far, less one
    wanted: set[str] = field(default_factory=set)   # job ids its generator asked for again
    orphaned_at: float | None = None   # since when its generator looks down with no other one up
    encoder_losses: int = 0    # times an encoder that had its jobs was lost (went down, or restarted)

    @property
    def wire_id(self) -> str:
        return wire_id(self.work.request.request_id, self.attempt)


def resume_after_output(flight: Flight) -> None:
    """Make the request continue after the tokens it already produced.
    The next generator is told which they are and how much of their text
    the client has, so it sends what the lost one held back and carries
    on its stop strings, grammar and penalties."""
    done = flight.token_ids[flight.resumed_from:]
    request = flight.work.request
    s = request.sampling
    sampling = msgspec.structs.replace(s, max_tokens=max(1, s.max_tokens - len(done)),
                                       min_tokens=max(0, s.min_tokens - len(done)))
    flight.work.request = msgspec.structs.replace(
        request, prompt_token_ids=request.prompt_token_ids + tuple(done), sampling=sampling,
        resumed_output=tuple(flight.token_ids), resumed_text_sent=flight.text_sent)
    flight.resumed_from = len(flight.token_ids)
