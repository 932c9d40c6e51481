"""One generation request as the generator's scheduler sees it.

A prompt is a token list in which each image occupies a run of placeholder
positions (an ImageSpan); the embedding that fills a run is found by the
image's content hash. Everything the scheduler mutates (progress, blocks,
status) lives on Request; sampling settings are frozen.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from pipeline.engine.block_table import BlockTable
from pipeline.engine.logprobs import MAX_TOP_LOGPROBS


def _check_int(name: str, value: object, minimum: int) -> None:
    # bool is an int subclass; a True max_tokens is a caller bug, not 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_number(name: str, value: object, low: float, high: float, low_open: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value > high or value < low or (low_open and value == low):
        bound = f"({low:g}, {high:g}]" if low_open else f"[{low:g}, {high:g}]"
        raise ValueError(f"{name} must be a number in {bound}, got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    min_tokens: int = 0
    temperature: float = 0.0          # 0 means greedy
    top_k: int = 0                    # 0 means no top-k cut
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()        # stop strings, matched by the detokenizer
    ignore_eos: bool = False
    repetition_penalty: float = 1.0   # 1 means off (engine/penalties.py says what each does)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, added to its logit)
    logprobs: int | None = None       # None: none; k: the chosen token's and the top k (engine/logprobs.py)
    grammar: str = ""                 # llguidance's grammar the output must follow (engine/grammar.py)

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, 1)
        _check_int("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        _check_int("top_k", self.top_k, 0)
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None:
            _check_int("seed", self.seed, 0)
        # Lists are accepted for convenience; stored as tuples so the object stays hashable.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))
        for token in self.stop_token_ids:
            _check_int("stop_token_ids[...]", token, 0)
        for text in self.stop:
            if not isinstance(text, str) or not text:
                raise ValueError(f"stop strings must be non-empty str, got {text!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        self._check_processors()

    def _check_processors(self) -> None:
        _check_number("repetition_penalty", self.repetition_penalty, 0.0, 2.0 ** 31, low_open=True)
        _check_number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_number("min_p", self.min_p, 0.0, 1.0)
        object.__setattr__(self, "logit_bias", tuple((t, float(b)) for t, b in self.logit_bias))
        for token, bias in self.logit_bias:
            _check_int("logit_bias token id", token, 0)
            _check_number(f"logit_bias[{token}]", bias, -100.0, 100.0)
        if not isinstance(self.grammar, str):
            raise ValueError(f"grammar must be a str, got {type(self.grammar).__name__}")
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0)
            if self.logprobs > MAX_TOP_LOGPROBS:
                raise ValueError(f"at most {MAX_TOP_LOGPROBS} top logprobs, got {self.logprobs}")


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
        _check_int("ImageSpan.start", self.start, 0)
        _check_int("ImageSpan.length", self.length, 1)
        _check_int("ImageSpan.offset", self.offset, 0)
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
    # Mutated by the scheduler.
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0      # tokens whose KV is in the cache
    block_ids: BlockTable = field(default_factory=BlockTable)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0

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
