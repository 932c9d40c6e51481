"""One generation request as the generator's scheduler sees it.

A prompt is a token list in which each image occupies a run of placeholder
positions (an ImageSpan); the embedding that fills a run is found by the
image's content hash. Everything the scheduler mutates (progress, blocks,
status) lives on Request; sampling settings are frozen.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pipeline.engine.block_table import BlockTable
from pipeline.sampling_params import SamplingParams, check_int


@dataclass(frozen=True)
class ImageSpan:
    """Prompt positions [start, start + length) filled by rows [offset,
    offset + length) of the embedding of item `key` (an image, or a video
    whose frames take runs of their own between timestamp text), which has
    `item_tokens` rows in all (None: just this span's)."""
    start: int
    length: int
    key: str
    offset: int = 0
    item_tokens: int | None = None

    def __post_init__(self) -> None:
        check_int("ImageSpan.start", self.start, 0)
        check_int("ImageSpan.length", self.length, 1)
        check_int("ImageSpan.offset", self.offset, 0)
        if not isinstance(self.key, str) or not self.key:
            raise ValueError(f"ImageSpan.key must be a non-empty str, got {self.key!r}")
        if self.item_tokens is None:
            object.__setattr__(self, "item_tokens", self.offset + self.length)
        elif self.offset + self.length > self.item_tokens:
            raise ValueError(f"ImageSpan rows [{self.offset}, {self.offset + self.length}) run past its item's "
                             f"{self.item_tokens}")

    @property
    def end(self) -> int:
        return self.start + self.length


PENDING_TOKEN = -1   # an output token sampled on the device and not read yet (Scheduler.advance)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI-style finish reason, None while unfinished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(eq=False)   # identity: queues find and remove requests by object
class Request:
    request_id: str
    prompt_token_ids: list[int]
    image_spans: tuple[ImageSpan, ...]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival: int = 0                  # arrival index, for FIFO order and metrics
    cache_salt: str = ""              # prefix-cached blocks are shared only with requests of the same salt
    priority: int = 0                 # lower first, under the priority policy (queue_order.py)
    # Mutated by the scheduler.
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0      # tokens whose KV is in the cache
    block_ids: BlockTable = field(default_factory=BlockTable)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0        # prompt tokens taken from the prefix cache when first admitted (vLLM's)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id}: the prompt is empty")
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.image_spans = tuple(sorted(self.image_spans, key=lambda s: s.start))
        self.eos_token_ids = tuple(self.eos_token_ids)
        previous_end = 0
        for span in self.image_spans:
            if span.start < previous_end:
                raise ValueError(f"request {self.request_id}: image spans overlap at {span.start}")
            if span.end > len(self.prompt_token_ids):
                raise ValueError(f"request {self.request_id}: image span [{span.start}, {span.end}) "
                                 f"runs past the prompt ({len(self.prompt_token_ids)} tokens)")
            previous_end = span.end
        # Past this position the request reads no embeddings: the scheduler's
        # per-step span lookups for decoding requests stop here.
        self.images_end = previous_end

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the whole list (the
        runner asks for a few tokens of long requests every step)."""
        prompt = self.prompt_token_ids
        n = len(prompt)
        if end <= n:
            return prompt[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return prompt[start:] + self.output_token_ids[:end - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def is_decoding(self) -> bool:
        """Its prompt is computed: the next step computes its last sampled token."""
        return self.num_tokens - self.num_computed_tokens == 1

    def spans_in(self, start: int, end: int) -> tuple[ImageSpan, ...]:
        """Image spans that overlap token positions [start, end)."""
        if start >= self.images_end:
            return ()
        return tuple(s for s in self.image_spans if s.start < end and s.end > start)

    def next_image_key(self) -> str | None:
        """The key of the first span not yet fully computed: the image this
        request reads next (or is blocked on)."""
        for span in self.image_spans:
            if span.end > self.num_computed_tokens:
                return span.key
        return None

    def keys_still_needed(self) -> set[str]:
        """Image keys with a span not yet fully computed: the embeddings this
        request still has to read."""
        if self.num_computed_tokens >= self.images_end:
            return set()
        return {s.key for s in self.image_spans if s.end > self.num_computed_tokens}


def stop_status(request: Request) -> RequestStatus | None:
    """Whether the request's last output token ends it. A stop or EOS token
    counts only once min_tokens are out, and it stays in the output; a stop
    token wins over reaching max_tokens at the same time."""
    params = request.sampling_params
    count = len(request.output_token_ids)
    if count == 0:
        return None
    token = request.output_token_ids[-1]
    if count >= params.min_tokens:
        if token in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if not params.ignore_eos and token in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
    if count >= params.max_tokens:
        return RequestStatus.FINISHED_LENGTH
    return None
