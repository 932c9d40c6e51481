"""What the scheduler decides: its configuration, and the plan of one step."""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.engine.queue_order import POLICIES
from pipeline.engine.request import ImageSpan, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int
    max_num_seqs: int
    block_size: int
    num_blocks: int
    encoder_cache_tokens: int
    aggregated: bool = False          # no encoders: the generator runs the vision tower itself
    local_encode_tokens: int = 0      # image tokens encoded locally per step (aggregated only)
    prefix_caching: bool = False      # computed prompt blocks kept for later prompts (prefix_cache.py)
    policy: str = "fcfs"              # the queues' order (queue_order.py)

    def __post_init__(self) -> None:
        for name, minimum in (("max_num_batched_tokens", 1), ("max_num_seqs", 1), ("block_size", 1),
                              ("num_blocks", 1), ("encoder_cache_tokens", 0), ("local_encode_tokens", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
                raise ValueError(f"SchedulerConfig.{name} must be an int >= {minimum}, got {value!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"SchedulerConfig.policy must be one of {POLICIES}, got {self.policy!r}")
        if self.aggregated and self.local_encode_tokens < 1:
            raise ValueError("SchedulerConfig.local_encode_tokens must be >= 1 in aggregated mode")
        if not self.aggregated and self.local_encode_tokens:
            raise ValueError("SchedulerConfig.local_encode_tokens is only meaningful in aggregated "
                             f"mode; got {self.local_encode_tokens} with aggregated=False")


@dataclass(frozen=True)
class Chunk:
    """Compute tokens [start, start + num_tokens) of one request this step."""
    request_id: str
    start: int
    num_tokens: int
    image_spans_in_chunk: tuple[ImageSpan, ...] = ()   # may be partly covered; slice the embedding
    sample: bool = False   # the chunk reaches the last known token: sample the next one

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass
class StepPlan:
    chunks: list[Chunk] = field(default_factory=list)
    # Aggregated mode: encode these before the forward and fill the space the
    # plan reserved with encoder_cache.set_payload(key, embedding).
    encode_keys: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    yielded: list[str] = field(default_factory=list)        # sat out: an embedding is not local
    refetch_keys: list[str] = field(default_factory=list)   # disaggregated: ask the encoders again

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


@dataclass(frozen=True)
class FinishedRequest:
    request_id: str
    status: RequestStatus
    finish_reason: str
    output_token_ids: tuple[int, ...]
    num_prompt_tokens: int
    num_preemptions: int
    num_cached_tokens: int = 0
