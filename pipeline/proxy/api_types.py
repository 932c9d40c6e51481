"""OpenAI request bodies as msgspec Structs, and the checks on them.

Unknown fields are ignored (clients send many), but every field we act on is
typed, so a wrong type is a 400 naming the field. The OpenAI fields this
server does not act on yet are typed too, so that a request which sets one
to anything but its neutral value is a 400 naming it, never a 200 that
silently did something else (`refused_field`).
"""

from __future__ import annotations

import argparse
from typing import Literal

import msgspec

from pipeline.arg_parser import json_object
from pipeline.proxy.ignored_fields import decode_warning_of_unknown
from pipeline.sampling_params import MAX_SEED


# An error's `type`, by its HTTP status, as vLLM names them (the names of
# openai-python's exception classes).
ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
               404: "NotFoundError", 422: "UnprocessableEntityError", 429: "RateLimitError",
               500: "InternalServerError", 503: "ServiceUnavailableError"}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "BadRequestError" if status < 500 else "InternalServerError")


class ApiError(Exception):
    """A client error: HTTP `status` with an OpenAI-style body; its type
    follows from the status (ERROR_TYPES) unless `kind` names one."""

    def __init__(self, message: str, status: int = 400, kind: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind or error_type(status)
        self.param = param

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param,
                          "code": self.status}}


class ImageUrl(msgspec.Struct):
    url: str
    detail: str | None = None


class VideoUrl(msgspec.Struct):
    url: str


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None
    image_url: ImageUrl | str | None = None
    video_url: VideoUrl | str | None = None


class MediaProcessorKwargs(msgspec.Struct):
    """`mm_processor_kwargs` as the common OpenAI-compatible servers take it:
    a video's sampling, frames per second or a frame count."""
    fps: float | None = None
    num_frames: int | None = None


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str | dict | None = None   # the API sends a JSON string


class ToolCallItem(msgspec.Struct):
    """One of an assistant message's earlier tool calls."""
    function: FunctionCall
    id: str | None = None
    type: str = "function"


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCallItem] | None = None
    tool_call_id: str | None = None      # a tool message's answer to that call
    name: str | None = None


class StreamOptions(msgspec.Struct):
    include_usage: bool = True   # vLLM's default once stream_options is sent
    continuous_usage_stats: bool = False


class StructuredOutputs(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's `structured_outputs`: one constraint, and its JSON options
    (checked and compiled in proxy/structured.py)."""
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict | None = None   # refused there
    disable_any_whitespace: bool = False        # this server's JSON is compact anyway
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    disable_fallback: bool = False              # no fallback here: a constraint is always enforced


class SamplingFields(msgspec.Struct):
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    n: int = 1
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool | int | None = None   # chat: a bool (with top_logprobs); completions: the top count
    top_logprobs: int | None = None
    tools: list | None = None           # chat only; checked in proxy/tools.py
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict | None = None
    prompt_logprobs: int | None = None   # vLLM's: each prompt token's logprob and the top k (not streamed)
    # Structured output in vLLM's forms (proxy/structured.py).
    structured_outputs: StructuredOutputs | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    # Accepted only at their neutral values (see NOT_YET_SUPPORTED).
    functions: list | None = None
    function_call: str | dict | None = None
    best_of: int | None = None
    # vLLM's output options (SamplingParams says what each does). The
    # byte-level tokenizers served here decode consecutive special tokens
    # with nothing between them, as vLLM's fast detokenizer does, so either
    # value of spaces_between_special_tokens reads the same.
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None
    return_tokens_as_token_ids: bool | None = None   # logprobs name tokens "token_id:<id>"
    return_token_ids: bool = False   # the answer carries its prompt's and its tokens' ids (proxy/token_ids.py)
    request_id: str | None = None   # vLLM's: names the request where no X-Request-Id came (proxy/access.py)
    bad_words: list[str] | None = None   # never written (proxy/sampling_fields.py)
    truncate_prompt_tokens: int | None = None   # keep the prompt's last k tokens (-1: the context's length)
    priority: int = 0   # vLLM's: lower first, with --scheduling-policy priority
    # vLLM's own fields accepted only at their defaults (NOT_YET_SUPPORTED).
    logits_processors: list | None = None
    vllm_xargs: dict | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0   # beam search's
    kv_transfer_params: dict | None = None
    # vLLM's: only requests with the same salt share prefix-cached KV blocks.
    cache_salt: str | None = None
    user: str | None = None   # OpenAI's end-user id: nothing here is per user


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = []
    mm_processor_kwargs: MediaProcessorKwargs | None = None
    # vLLM's: extra variables for the chat template (e.g. enable_thinking), and
    # whether it ends with the assistant's turn opened.
    chat_template_kwargs: dict[str, object] | None = None
    add_generation_prompt: bool = True
    # vLLM's: the prompt ends inside the final message, which the model goes
    # on writing; and the tokenizer's own special tokens (a BOS) around the
    # rendered prompt, which the template usually writes itself.
    continue_final_message: bool = False
    add_special_tokens: bool = False
    documents: list[dict[str, str]] | None = None   # vLLM's: for templates that take retrieved texts
    echo: bool = False
    chat_template: str | None = None   # only with --trust-request-chat-template (ModelInfo.template_for)
    include_reasoning: bool = True   # vLLM's: false leaves the reasoning out (with --reasoning-parser)
    # OpenAI's: template variables, as on the Responses API (effort_variables).
    reasoning_effort: str | None = None
    # OpenAI's, with nothing to act on here: ids and tags for the caller's
    # own records, and a routing hint (the prefix cache needs no key).
    metadata: dict[str, str] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # OpenAI's, accepted only at their neutral values (NOT_YET_SUPPORTED).
    modalities: list[str] | None = None
    audio: dict | None = None
    prediction: dict | None = None
    web_search_options: dict | None = None
    verbosity: str | None = None
    store: bool | None = None
    service_tier: str | None = None


class CompletionRequest(SamplingFields):
    max_tokens: int | None = 16   # the legacy API's default (OpenAI's and vLLM's); null: as chat
    prompt: str | list | None = None   # a string or token ids, or a batch of either (completion_prompts)
    add_special_tokens: bool = True    # vLLM's: the tokenizer's own (a BOS) around a text prompt
    echo: bool = False
    suffix: str | None = None


def _neutral(value) -> bool:
    """None, False, 0, an empty list or dict: what a client sends for "off"."""
    return value is None or value is False or value == 0 or value == [] or value == {}


# field -> whether a value of it asks for nothing this server would ignore.
NOT_YET_SUPPORTED = {
    "functions": _neutral, "function_call": lambda v: v in (None, "none"),   # the legacy form of tools
    "best_of": lambda v: v in (None, 1),
    "suffix": lambda v: not v,
    "logits_processors": _neutral, "vllm_xargs": _neutral,
    "use_beam_search": _neutral, "length_penalty": lambda v: v == 1.0,
    "kv_transfer_params": _neutral,   # vLLM's prefill/decode KV connectors
    # OpenAI's chat fields for what the models served here do not have.
    "modalities": lambda v: v is None or v == ["text"],
    "audio": lambda v: v is None,
    "prediction": lambda v: v is None,
    "web_search_options": lambda v: v is None,
    "verbosity": lambda v: v in (None, "medium"),
    "store": _neutral,   # stored chat completions (OpenAI's evals and distillation)
    "service_tier": lambda v: v in (None, "auto", "default"),
}
# What a refused field's error says beyond its name, where there is more to say.
_REFUSAL_HINTS = {
    "modalities": "the models served here write text only (modalities [\"text\"])",
    "verbosity": "the models served here take no verbosity (leave it unset or medium)",
    "store": "chat completions are not stored here",
    "service_tier": "this server has one tier (auto or default)",
    "vllm_xargs": "no custom logits processors are loaded here",
    "use_beam_search": "beam search is not served; ask for n choices instead",
    "length_penalty": "it weighs beam search, which is not served",
    "kv_transfer_params": "KV caches are not moved between servers here (EPD moves image embeddings)",
}
# reasoning_effort's values (chat's, and the Responses API's reasoning.effort).
EFFORTS = ("none", "minimal", "low", "medium", "high")


def effort_variables(effort: str | None) -> dict:
    """A reasoning effort as the chat template's variables, as vLLM passes
    it: none turns thinking off (enable_thinking, which thinking models'
    templates read), and the effort itself for templates that read it."""
    if effort is None:
        return {}
    return {"enable_thinking": effort != "none", "reasoning_effort": effort}
# Template variables the server sets itself: chat_template_kwargs may not.
RESERVED_TEMPLATE_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


def template_kwargs_arg(text: str) -> dict:
    """--default-chat-template-kwargs JSON: template variables for every chat
    (a request's chat_template_kwargs override them), e.g. '{"enable_thinking": false}'."""
    value = json_object(text, '{"enable_thinking": false}')
    if taken := RESERVED_TEMPLATE_VARIABLES & set(value):
        raise argparse.ArgumentTypeError(f"may not set {', '.join(sorted(taken))}: each request's own fields do")
    return value


def check_template_kwargs(kwargs: dict | None) -> None:
    """A 400 for chat_template_kwargs that would set what the request's own fields set."""
    if taken := RESERVED_TEMPLATE_VARIABLES & set(kwargs or {}):
        raise ApiError(f"chat_template_kwargs may not set {', '.join(sorted(taken))}: the request's own fields do",
                       param="chat_template_kwargs")


# Chat fields that a text completion does not take.
CHAT_ONLY = {"tools": _neutral, "tool_choice": lambda v: v in (None, "none"), "parallel_tool_calls": lambda v: True}


def refused_field(request) -> str | None:
    """The first field set to something this server does not do yet, if any."""
    for name, neutral in NOT_YET_SUPPORTED.items():
        if not neutral(getattr(request, name, None)):
            return name
    return None


MAX_N = 16   # choices a request may ask for (each is a generate request of its own)
_chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)
_completion_decoder = msgspec.json.Decoder(CompletionRequest)


class _StrictChat(ChatCompletionRequest, forbid_unknown_fields=True):
    """ChatCompletionRequest that refuses a field it lacks (ignored_fields.py)."""


class _StrictCompletion(CompletionRequest, forbid_unknown_fields=True):
    """CompletionRequest that refuses a field it lacks (ignored_fields.py)."""


_BODIES = {"chat": (msgspec.json.Decoder(_StrictChat), _chat_decoder, ChatCompletionRequest),
           "completion": (msgspec.json.Decoder(_StrictCompletion), _completion_decoder, CompletionRequest)}


def decode_json(body: bytes, kind, decoder: msgspec.json.Decoder | None = None, strict=None):
    """A request body as Struct `kind`; a 400 naming what is wrong otherwise.
    With `strict` (its decoder that forbids unknown fields), a field `kind`
    lacks is ignored with a warning (ignored_fields.py)."""
    try:
        if strict is not None:
            return decode_warning_of_unknown(body, strict, decoder, kind)
        return (decoder or msgspec.json.Decoder(kind)).decode(body)
    except msgspec.ValidationError as exc:
        raise ApiError(f"invalid request: {exc}") from None
    except msgspec.DecodeError as exc:
        raise ApiError(f"malformed JSON body: {exc}") from None


def parse_body(body: bytes, kind: Literal["chat", "completion"]):
    strict, lenient, struct = _BODIES[kind]
    request = decode_json(body, struct, lenient, strict)
    if not 1 <= request.n <= MAX_N:
        raise ApiError(f"n must be in [1, {MAX_N}], got {request.n}", param="n")
    if (field := refused_field(request)) is not None:
        hint = _REFUSAL_HINTS.get(field, "leave it unset")
        raise ApiError(f"'{field}' is not supported by this server yet; {hint}", param=field)
    if kind == "completion" and (field := next((f for f, neutral in CHAT_ONLY.items()
                                                if not neutral(getattr(request, f))), None)):
        raise ApiError(f"'{field}' is for /v1/chat/completions; text completions take no tools", param=field)
    if request.stream_options is not None:
        if not request.stream:
            raise ApiError("stream_options can only be set when stream is true", param="stream_options")
    if request.seed is not None and not 0 <= request.seed <= MAX_SEED - (request.n - 1):
        # n choices are seeded seed, seed + 1, ...: each must fit.
        raise ApiError(f"seed must be in [0, {MAX_SEED - (request.n - 1)}] with n = {request.n}, got {request.seed}",
                       param="seed")
    for name in ("max_tokens", "max_completion_tokens"):
        if (value := getattr(request, name)) is not None and value < 1:
            raise ApiError(f"{name} must be at least 1, got {value}", param=name)
    if request.top_k is not None and request.top_k < -1:
        raise ApiError("top_k must be -1 or 0 (off) or a positive number of tokens", param="top_k")
    if kind == "chat":
        check_template_kwargs(request.chat_template_kwargs)
        if request.reasoning_effort not in (None, *EFFORTS):
            raise ApiError(f"reasoning_effort must be one of {', '.join(EFFORTS)}", param="reasoning_effort")
        if request.metadata is not None and len(request.metadata) > 16:
            raise ApiError("metadata takes at most 16 keys", param="metadata")
    if kind == "chat" and not request.messages:
        raise ApiError("messages must be a non-empty list", param="messages")
    if kind == "chat" and request.continue_final_message and request.add_generation_prompt:
        raise ApiError("continue_final_message needs add_generation_prompt false: the answer goes on from the "
                       "final message, not from a new turn", param="continue_final_message")
    return request   # a completion's prompt: completion_prompts, where the prompts are used


def completion_prompts(prompt) -> list[str | list[int]]:
    """The prompts of a completion request, as vLLM takes them: a string, a
    list of token ids, or a batch (a list) of either, each answered as its
    own choices. ApiError for anything else, or an empty one."""
    def is_ids(value) -> bool:
        return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    if isinstance(prompt, str) or (is_ids(prompt) and prompt):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt)
                                                  or all(is_ids(p) for p in prompt)):
        prompts = prompt
    else:
        raise ApiError("prompt must be a string, a list of token ids, or a non-empty list of either",
                       param="prompt")
    if any(not p for p in prompts):
        raise ApiError("the prompt is empty" if len(prompts) == 1 else "a prompt of the batch is empty",
                       param="prompt")
    return prompts


def video_url_of(part: ContentPart) -> str:
    url = part.video_url.url if isinstance(part.video_url, VideoUrl) else part.video_url
    if not url:
        raise ApiError("video_url part without a url", param="messages")
    return url


def image_url_of(part: ContentPart) -> str:
    url = part.image_url.url if isinstance(part.image_url, ImageUrl) else part.image_url
    if not url:
        raise ApiError("image_url part without a url", param="messages")
    return url
