"""Every message between EPD processes: msgspec Structs in one tagged union,
msgpack on the wire.

Decoding is only ever against `Message`, the declared union, so a peer can
never make us build an arbitrary type; no pickle anywhere. Structs are frozen,
array-like (positional, compact) and omit defaults. New fields go at the end
with a default, so older peers still decode newer messages.

Tensors never ride in a message: an `ArenaHandle` says where they are.
"""

from __future__ import annotations

import uuid
from typing import Annotated

import msgspec

# A count that is never negative: a negative one from a broken or hostile peer
# is refused at decode (it would shrink the encoder's batch totals).
Count = Annotated[int, msgspec.Meta(ge=0)]


class _Msg(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, gc=False,
           tag_field="t"):
    pass


class ArenaHandle(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, gc=False):
    """Where one embedding lives: `nbytes` at `offset` of arena `arena_id`,
    viewed as `shape`/`dtype`. `generation` is the allocation's serial number;
    a reader whose blocks were since reused sees another number and must not
    use the bytes it read."""

    arena_id: str
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    generation: int


class ArenaInfo(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, gc=False):
    """How a consumer opens an encoder's arena, once.

    kind "shm": data in the POSIX shared-memory segment `data_name`.
    kind "cuda": data in a device buffer exported by CUDA IPC (`cuda_handle`
    holds the opaque export; `device` is the producer's device index).
    Either way `generations_name` is a shared-memory segment of int64, one
    per block, that readers check handles against."""

    arena_id: str
    kind: str
    capacity: int
    block_bytes: int
    generations_name: str
    data_name: str = ""
    device: int = -1
    cuda_handle: bytes = b""


class EncodeJob(_Msg, tag="encode"):
    """Encode one image for one request and hand it to `consumer`.

    `content_hash` is the salted hash the proxy computed from `media`; the
    encoder recomputes it, so a wrong or reused id can never alias another
    image's embedding. `expected_tokens` is the placeholder count the prompt
    was built with; a different count is a failure, never a silent fill."""

    job_id: str
    request_id: str
    content_hash: str
    media: bytes
    consumer: str            # inbox address of the generator that needs it
    expected_tokens: Count
    reply_to: str = ""       # inbox of the sender, for failures (the proxy)
    modality: str = "image"  # or "video"
    # A video's sampling asked for by the request (VideoOptions); part of its hash's salt.
    video_fps: float | None = None
    video_frames: int | None = None


class EmbeddingReady(_Msg, tag="ready"):
    """The embedding of `content_hash` is in `handle`, leased to the consumer
    under `lease_id` until it sends ReleaseLease (or stops heartbeating)."""

    job_id: str
    request_id: str
    content_hash: str
    handle: ArenaHandle
    lease_id: str
    encoder_id: str
    dedup: bool = False


class EncodeFailed(_Msg, tag="failed"):
    """An encode job could not be done. `retryable` is false for bad media
    (another encoder would fail the same way) and true for capacity or
    internal errors."""

    job_id: str
    request_id: str
    content_hash: str
    reason: str
    retryable: bool
    encoder_id: str


class ReleaseLease(_Msg, tag="release"):
    lease_ids: tuple[str, ...]
    owner: str


class Heartbeat(_Msg, tag="heartbeat"):
    """Liveness of `sender`; an encoder drops the leases of a consumer whose
    heartbeats stop, and those its predecessor at the same address took when
    it names a new incarnation (started at `started_at`, wall clock)."""

    sender: str
    sent_at: float
    incarnation: str = ""
    started_at: float = 0.0


class Hello(_Msg, tag="hello"):
    """Ask an encoder to announce itself to `reply_to`. A consumer on the
    encoder's host may name a shared-memory ring (`ring`, on host `host`)
    where it also takes EmbeddingReady messages: the fast lane of
    pipeline/arena/ring.py, beside this socket."""

    sender: str
    reply_to: str
    ring: str = ""
    host: str = ""
    incarnation: str = ""    # as in Heartbeat
    started_at: float = 0.0


class Wake(_Msg, tag="wake"):
    """Nothing but a wake-up: a ring message is waiting for a consumer that
    was blocked on its socket."""

    sender: str


class EncoderAnnounce(_Msg, tag="announce"):
    """An encoder's identity and arena. `widths` maps modality to embedding
    width, which may exceed the language model's hidden size."""

    encoder_id: str
    address: str
    model_id: str
    arena: ArenaInfo
    widths: dict[str, int]


class FetchEmbedding(_Msg, tag="fetch"):
    """Ask an encoder to hand out an embedding it already holds again (the
    generator evicted its copy while a request still needs it). Answered
    like an EncodeJob: EmbeddingReady, or EncodeFailed if it is gone."""

    job_id: str
    request_id: str
    content_hash: str
    consumer: str
    expected_tokens: int


class EmbeddingWanted(_Msg, tag="wanted"):
    """A generator lost an embedding that request `request_id` still needs
    (its encoder died before it was read, or it was evicted here and is gone
    from that encoder too) and asks the request's proxy to have it encoded
    again from the media the proxy holds. Answered like the request's first
    encode jobs: EmbeddingReady from whichever encoder gets the job."""

    request_id: str
    content_hashes: tuple[str, ...]
    consumer: str        # the generator's inbox
    reason: str = ""     # for the proxy's log
    encoder: str = ""    # the encoder that went silent on it, if one did: the job goes elsewhere


class Sampling(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True, gc=False):
    max_tokens: int
    min_tokens: int = 0
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # The logits processors (engine/penalties.py); field names as SamplingParams'.
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None   # the chosen token's logprob and the top k, per output token
    grammar: str = ""             # llguidance's grammar the output must follow (structured output)
    # vLLM's output options (SamplingParams says what each does).
    allowed_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()


class GenerateRequest(_Msg, tag="generate"):
    """A whole request, sent once. Placeholder run k fills prompt positions
    image_spans[k] with rows of the embedding of content hash image_keys[k]
    (the runs of one video share its key); grids[i] is item i's, in prompt
    order. Encoders deliver the embeddings separately. In aggregated mode
    the generator encodes the images itself from `media`."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    image_spans: tuple[tuple[int, int], ...]
    image_keys: tuple[str, ...]
    grids: tuple[tuple[int, int, int], ...]
    sampling: Sampling
    reply_to: str
    media: tuple[bytes, ...] = ()
    # Per item (grids[i]): the seconds one temporal patch of a video spans,
    # None for an image; empty when every item is an image.
    seconds_per_grid: tuple[float | None, ...] = ()
    # Aggregated mode: per item of `media`, "image" or "video" (empty: all
    # images), and the request's own video sampling.
    media_kinds: tuple[str, ...] = ()
    video_fps: float | None = None
    video_frames: int | None = None
    # Moved here after a generator was lost: the tokens it had produced (the
    # end of prompt_token_ids), and the characters of their text the client has.
    resumed_output: tuple[int, ...] = ()
    resumed_text_sent: int = 0
    # vLLM's cache_salt: prefix-cached blocks are shared only between requests with the same one.
    cache_salt: str = ""
    # vLLM's priority (lower first), for a generator with --scheduling-policy priority.
    priority: int = 0


class TokenDelta(_Msg, tag="delta"):
    """What a request produced since the last delta. `error` is set when it
    ended in failure (finish_reason "error"), with `status` an HTTP status
    saying whose fault it was (400: the request's, e.g. a bad image; 5xx: ours)."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finished: bool = False
    finish_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str = ""
    status: int = 0
    # Per token of token_ids when the request asked: (its logprob, the top ids, their logprobs).
    logprobs: tuple[tuple[float, tuple[int, ...], tuple[float, ...]], ...] = ()
    # On the last, as vLLM's stop_reason: the stop string or the stop token id that ended it.
    stop_reason: str | int | None = None
    # On the last delta: seconds queued, in prefill, in decode at its generator (engine/request_phases.py).
    phases: tuple[float, ...] = ()
    # On the last delta: prompt tokens whose KV came from the prefix cache (usage's cached_tokens).
    cached_tokens: int = 0
    # On the first delta, when the request asked (prompt_logprobs): per prompt
    # token from the second on, (token, logprob, rank, top ids, their logprobs).
    prompt_logprobs: tuple[tuple[int, float, int, tuple[int, ...], tuple[float, ...]], ...] = ()


class AbortRequest(_Msg, tag="abort"):
    request_ids: tuple[str, ...]


class StatsRequest(_Msg, tag="stats?"):
    reply_to: str
    incarnation: str = ""   # the asker's: a new one means the asker restarted (see new_incarnation)


class StageStats(_Msg, tag="stats"):
    """A stage's counters and gauges, for metrics and for leak checks."""

    stage: str
    instance: str
    counters: dict[str, int]
    gauges: dict[str, float]
    address: str = ""   # the stage's inbox
    # Differs between a process and the one restarted in its place, so a
    # peer sees a restart that was quicker than its down timeout.
    incarnation: str = ""


def new_incarnation() -> str:
    """An id for this process's StageStats.incarnation."""
    return uuid.uuid4().hex[:16]


Message = (EncodeJob | EmbeddingReady | EncodeFailed | ReleaseLease | Heartbeat | Hello
           | EncoderAnnounce | StatsRequest | StageStats | FetchEmbedding | GenerateRequest
           | TokenDelta | AbortRequest | Wake | EmbeddingWanted)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def decode(data: bytes | memoryview) -> Message:
    """Raises msgspec.DecodeError / ValidationError for anything that is not
    a well-formed declared message."""
    return _decoder.decode(data)
