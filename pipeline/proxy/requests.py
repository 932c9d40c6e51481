"""From an OpenAI request to the work the stages do: fetch and check each
image and video, render and tokenize the prompt, hash the media, fill the
sampling settings, check the context length."""

from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import dataclass, field
from functools import cached_property

import jinja2
import msgspec

from pipeline import protocol
from pipeline.hashing import content_hash
from pipeline.processing.chat_template import ChatTemplate
from pipeline.processing.image import ImageDecodeError, check_source_size, read_image_size
from pipeline.processing.content_format import flattened
from pipeline.processing.processor import MultimodalPrompt, Processor
from pipeline.processing.video import VideoOptions, VideoPlan
from pipeline.proxy.api_types import (
    ApiError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    effort_variables,
    image_url_of,
    video_url_of,
)
from pipeline.proxy.echo import Echo, chat_echo, completion_echo
from pipeline.proxy.flights import Work
from pipeline.proxy.media_fetch import FetchPolicy, fetch_image
from pipeline.proxy.reasoning import ReasoningParser, ReasoningSplit
from pipeline.proxy.sampling_fields import bad_words_token_ids, processor_fields, stop_strings
from pipeline.proxy.structured import grammar_of
from pipeline.proxy.tools import ToolRequest, forced_grammar, tag_tokens_of, template_tool_calls, tool_request
from pipeline.proxy.video_items import VideoLimits, checked_plan, video_key, video_options
from pipeline.sampling_params import MAX_TOP_LOGPROBS, SamplingParams

log = logging.getLogger("epd.proxy")


@dataclass(frozen=True)
class ModelInfo:
    model_id: str
    processor: Processor
    max_context: int
    salt: bytes
    aggregated: bool = False   # generators encode images themselves: they get the bytes
    max_images: int = 16       # images and videos
    video_limits: VideoLimits = VideoLimits()
    served_names: tuple[str, ...] = ()   # what clients may call it (default: model_id)
    defaults: dict = field(default_factory=dict)   # generation_config.json's, for unset request fields
    trust_request_chat_template: bool = False   # vLLM's flag: a request may bring its own chat template
    scheduling_policy: str = "fcfs"   # the generators' (vLLM's --scheduling-policy): priority takes priorities
    reasoning: ReasoningParser | None = None   # --reasoning-parser: chat answers split into reasoning and content
    max_logprobs: int = MAX_TOP_LOGPROBS   # --max-logprobs: the most top logprobs a request may ask for
    tokens_as_ids: bool = False   # --return-tokens-as-token-ids: the default of the request field
    # --default-chat-template-kwargs: template variables for every chat, under the request's own.
    template_kwargs: dict = field(default_factory=dict)
    # --chat-template-content-format: how templates take a message's content (content_format.py).
    content_format: str = "auto"
    exclude_tools_when_none: bool = False   # --exclude-tools-when-tool-choice-none

    @property
    def names(self) -> tuple[str, ...]:
        return self.served_names or (self.model_id,)

    @cached_property
    def tag_tokens(self) -> frozenset[str]:
        """The tool-call tags its tokenizer has as tokens (proxy/tools.py)."""
        return tag_tokens_of(self.processor.tokenizer)

    def template_for(self, source: str | None) -> ChatTemplate:
        """The chat template a request renders with: the checkpoint's, or its
        own `chat_template` where the server trusts requests with one (a
        template is code: sandboxed, but a loop in it costs the proxy)."""
        if source is None:
            return self.processor.template
        if not self.trust_request_chat_template:
            raise ApiError("a chat_template in the request is refused: this server was not started with "
                           "--trust-request-chat-template", param="chat_template")
        try:
            return self.processor.template.replaced(source)
        except ValueError as exc:
            raise ApiError(str(exc), param="chat_template") from None

    def content_for(self, template: ChatTemplate, messages: list[dict], tools: bool) -> list[dict]:
        """Messages as `template` takes their content: parts, or each list
        flattened to one string (--chat-template-content-format; auto asks
        the template)."""
        chosen = self.content_format
        if chosen == "auto":
            chosen = template.content_format(tools=tools)
            _log_detected(template.source, chosen)
        return flattened(messages, self.processor.media_placeholder) if chosen == "string" else messages

    def template_kwargs_for(self, asked: dict | None) -> dict:
        """A chat's template variables: the server's defaults, then the request's chat_template_kwargs."""
        return {**self.template_kwargs, **(asked or {})}

    def check_name(self, name: str | None) -> str:
        """The name a response reports: the one asked for, else the first.
        404 in the common servers' words for a model not served here."""
        if name is None:
            return self.names[0]
        if name not in self.names:
            raise ApiError(f"The model `{name}` does not exist.", status=404, param="model")
        return name


@functools.lru_cache(maxsize=64)
def _log_detected(source: str, chosen: str) -> None:
    """Once per template, as vLLM logs it: the content format auto found."""
    log.info("detected the chat template's content format to be %r (--chat-template-content-format overrides it)",
             chosen)


async def fetch_all(media: list[tuple[str, str]], policy: FetchPolicy, session=None) -> list[bytes]:
    """Each (kind, url)'s bytes, fetched at once. The first failure cancels
    the rest: a bad URL must not leave its siblings downloading for nobody."""
    tasks = [asyncio.ensure_future(fetch_image(url, policy, session, kind)) for kind, url in media]
    try:
        return await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()
                # A sibling that fails as it is cancelled is not worth a warning.
                task.add_done_callback(lambda t: t.cancelled() or t.exception())


@dataclass(frozen=True)
class ChatMedia:
    """A chat's images and videos, fetched and read as far as their headers:
    what its prompt's placeholders expand by."""
    kinds: list[str]              # "image" or "video", in message order
    data: list[bytes]
    sizes: list[tuple[int, int]]  # each image's (height, width)
    plans: list[VideoPlan]        # each video's sampling
    options: VideoOptions | None  # the request's fps or num_frames


async def chat_media(media: list[tuple[str, str]], req, model: ModelInfo, policy: FetchPolicy,
                     session=None) -> ChatMedia:
    """Each (kind, URL) fetched and checked (a 400 for too many, or for one
    that is bad or too large); `req`: its mm_processor_kwargs sample videos."""
    if len(media) > model.max_images:
        raise ApiError(f"too many images and videos: {len(media)} (at most {model.max_images} per request)",
                       param="messages")
    fetched = await fetch_all(media, policy, session)
    kinds = [kind for kind, _ in media]
    images = [data for kind, data in zip(kinds, fetched) if kind == "image"]
    videos = [data for kind, data in zip(kinds, fetched) if kind == "video"]
    sizes = [_checked_size(i, data, model) for i, data in enumerate(images, start=1)]
    options = video_options(req) if videos else None
    cfg = model.processor.video_config
    plans = [checked_plan(i, data, cfg, options, model.video_limits) for i, data in enumerate(videos, start=1)]
    return ChatMedia(kinds, fetched, sizes, plans, options)


async def chat_work(req: ChatCompletionRequest, model: ModelInfo, policy: FetchPolicy, request_id: str,
                    reply_to: str, session=None) -> Work:
    tools = tool_request(req)
    if model.exclude_tools_when_none and tools.choice == "none":
        tools = ToolRequest()   # vLLM's --exclude-tools-when-tool-choice-none: the template gets no tools
    messages, media = plain_messages(req.messages)
    template = model.template_for(req.chat_template)
    check_template_takes(template, tools, messages, req.documents)
    messages = model.content_for(template, messages, tools.template_tools is not None)
    grammar = forced_grammar(tools, model.tag_tokens) if tools.forced else ""
    # reasoning_effort's variables, under the request's own chat_template_kwargs.
    template_kwargs = model.template_kwargs_for({**effort_variables(req.reasoning_effort),
                                                 **(req.chat_template_kwargs or {})})
    found = await chat_media(media, req, model, policy, session)
    try:
        # Inline, not in a thread: rendering and tokenizing a prompt takes far
        # less than a thread hop costs under the GIL.
        prompt = model.processor.chat_prompt(messages, found.sizes, found.plans, tools.template_tools,
                                             req.add_generation_prompt, template_kwargs,
                                             req.continue_final_message, req.add_special_tokens, req.documents,
                                             template)
    except (ValueError, jinja2.TemplateError) as exc:
        raise ApiError(f"cannot build the prompt: {exc}", param="messages") from None
    # Items in prompt order are the media in message order.
    cfg = model.processor.video_config
    keys = [video_key(data, model.model_id, cfg, found.options) if kind == "video" else content_hash(data, model.salt)
            for kind, data in zip(found.kinds, found.data)]
    items = [_Item(kind, data, key) for kind, data, key in zip(found.kinds, found.data, keys)]
    options = found.options
    reasoning = (model.reasoning.for_request(prompt.token_ids, template_kwargs, req.include_reasoning)
                 if model.reasoning is not None else None)
    return _work(req, model, request_id, reply_to, prompt, items, options, grammar, chat_echo(req), reasoning)


async def completion_work(req: CompletionRequest, model: ModelInfo, request_id: str, reply_to: str,
                          prompt: str | list[int]) -> Work:
    """One prompt of the request (completion_prompts) as work for a generator."""
    if isinstance(prompt, str):
        ids = model.processor.tokenizer.encode(prompt, req.add_special_tokens)
    else:
        ids = list(prompt)
        vocab = model.processor.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ApiError(f"prompt token ids must be in [0, {vocab})", param="prompt")
    if not ids:
        raise ApiError("the prompt is empty", param="prompt")
    kept = _truncated(MultimodalPrompt(ids, [], []), req.truncate_prompt_tokens, model.max_context).token_ids
    if len(kept) < len(ids):
        prompt = ids = kept   # what the model sees, and so what an echo repeats
    echo = completion_echo(req, prompt, ids, model.processor.tokenizer)
    return _work(req, model, request_id, reply_to, MultimodalPrompt(ids, [], []), [], None, echo=echo)


def _truncated(prompt: MultimodalPrompt, keep: int | None, max_context: int) -> MultimodalPrompt:
    """vLLM's truncate_prompt_tokens: the prompt's last `keep` tokens (-1:
    the context's length). A prompt's images and videos must all be kept:
    one cut in part, or dropped, is a 400 rather than a prompt whose media
    no longer match the request's."""
    if keep is None:
        return prompt
    if keep == -1:
        keep = max_context
    if not 1 <= keep <= max_context:
        raise ApiError(f"truncate_prompt_tokens must be -1 or in [1, {max_context}], got {keep}",
                       param="truncate_prompt_tokens")
    cut = len(prompt.token_ids) - keep
    if cut <= 0:
        return prompt
    if any(start < cut for start, _ in prompt.image_spans):
        raise ApiError(f"truncate_prompt_tokens={keep} would cut the prompt's images or videos "
                       f"(the prompt has {len(prompt.token_ids)} tokens)", param="truncate_prompt_tokens")
    return MultimodalPrompt(prompt.token_ids[cut:], [(start - cut, length) for start, length in prompt.image_spans],
                            prompt.grids, prompt.seconds_per_grid, prompt.span_items)


def plain_messages(chat: list[ChatMessage]) -> tuple[list[dict], list[tuple[str, str]]]:
    """Messages as the chat template expects them, and the (kind, URL) of
    each image and video, in order."""
    messages, urls = [], []
    for i, m in enumerate(chat):
        if m.content is None or isinstance(m.content, str):
            message = {"role": m.role, "content": m.content or ""}
        else:
            message = {"role": m.role, "content": [_part(part, urls) for part in m.content]}
        if m.tool_calls:
            message["tool_calls"] = template_tool_calls(m.tool_calls, f"messages[{i}]")
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            message["name"] = m.name
        messages.append(message)
    return messages, urls


def _part(part, urls: list[tuple[str, str]]) -> dict:
    if part.type == "text":
        return {"type": "text", "text": part.text or ""}
    if part.type == "image_url":
        urls.append(("image", image_url_of(part)))
        return {"type": "image"}
    if part.type == "video_url":
        urls.append(("video", video_url_of(part)))
        return {"type": "video"}
    raise ApiError(f"unsupported content part type {part.type!r}", param="messages")


def check_template_takes(template, tools: ToolRequest, messages: list[dict], documents: list | None = None) -> None:
    """A 400 for tools, earlier tool calls or documents that the
    checkpoint's chat template never reads: the model would never see them."""
    if tools.tools and not template.reads("tools", tools=True):
        raise ApiError("this model's chat template takes no tools: the model would never see them",
                       param="tools")
    if any("tool_calls" in m for m in messages) and not template.reads("tool_calls", tools=bool(tools.tools)):
        raise ApiError("this model's chat template does not render an assistant message's tool_calls",
                       param="messages")
    if documents and not template.reads("documents", tools=bool(tools.tools)):
        raise ApiError("this model's chat template takes no documents: the model would never see them "
                       "(--chat-template can give it one that does)", param="documents")


def _checked_size(number: int, data: bytes, model: ModelInfo) -> tuple[int, int]:
    """The image's size from its header alone; a bad or oversized image is a 400."""
    try:
        height, width = read_image_size(data)
        check_source_size(height, width, model.processor.image_config)
    except ImageDecodeError as exc:
        raise ApiError(f"image {number}: {exc}", param="messages") from None
    return height, width


@dataclass(frozen=True)
class _Item:
    kind: str     # "image" or "video"
    media: bytes
    key: str      # its salted content hash


def _work(req, model: ModelInfo, request_id: str, reply_to: str, prompt: MultimodalPrompt, items: list[_Item],
          options: VideoOptions | None, tool_grammar: str = "", echo: Echo | None = None,
          reasoning: ReasoningSplit | None = None) -> Work:
    prompt = _truncated(prompt, req.truncate_prompt_tokens, model.max_context)
    ids = prompt.token_ids
    room = model.max_context - len(ids)
    defaults = model.defaults
    asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    if asked is not None and len(ids) + asked > model.max_context:
        raise ApiError(f"This model's maximum context length is {model.max_context} tokens. However, you "
                       f"requested {len(ids) + asked} tokens ({len(ids)} in the messages, {asked} "
                       "in the completion). Please reduce the length of the messages or completion.",
                       param="max_tokens")
    # As vLLM: the smallest of what was asked, the room left and the checkpoint's default.
    max_tokens = min(v for v in (asked, room, defaults.get("max_tokens")) if v is not None)
    if max_tokens < 1:
        raise ApiError(f"This model's maximum context length is {model.max_context} tokens, and the prompt "
                       f"has {len(ids)}: no room is left for the completion.",
                       param="messages" if hasattr(req, "messages") else "prompt")
    fields = processor_fields(req, model.processor.tokenizer.vocab_size, defaults, model.max_logprobs)
    fields["bad_words_token_ids"] = bad_words_token_ids(req.bad_words, model.processor.tokenizer)
    if echo is not None and echo.token_ids and fields["logprobs"] is not None:
        # The echoed prompt's tokens carry logprobs too: its prompt logprobs, with the same top count.
        fields["prompt_logprobs"] = max(fields["prompt_logprobs"] or 0, fields["logprobs"])
    try:
        sampling = protocol.Sampling(
            max_tokens=max_tokens, min_tokens=req.min_tokens,
            temperature=_given(req.temperature, defaults, "temperature", 1.0),
            top_k=max(_given(req.top_k, defaults, "top_k", 0), 0),   # -1 and 0 both mean off
            top_p=_given(req.top_p, defaults, "top_p", 1.0), seed=req.seed,
            stop=stop_strings(req.stop), stop_token_ids=tuple(req.stop_token_ids or ()),
            ignore_eos=req.ignore_eos, grammar=_held_to(grammar_of(req, tool_grammar), reasoning),
            **fields)
        _check_sampling(sampling)
    except ValueError as exc:
        raise ApiError(str(exc)) from None
    span_items = prompt.item_of_span()
    item_tokens = [0] * len(items)
    for (_, length), item in zip(prompt.image_spans, span_items):
        item_tokens[item] += length
    # In EPD mode pixels never go to a generator: encoders hand it embeddings.
    media = tuple(item.media for item in items) if model.aggregated else ()
    kinds = tuple(item.kind for item in items) if model.aggregated else ()
    fps, frames = (options.fps, options.num_frames) if options is not None else (None, None)
    request = protocol.GenerateRequest(request_id, tuple(ids), tuple(prompt.image_spans),
                                       tuple(items[i].key for i in span_items), tuple(prompt.grids), sampling,
                                       reply_to, media, tuple(prompt.seconds_per_grid), kinds, fps, frames,
                                       cache_salt=_cache_salt(req), priority=_priority(req, model))
    jobs = [protocol.EncodeJob(f"{request_id}/{i}", request_id, item.key, item.media, "", tokens, reply_to,
                               item.kind, fps if item.kind == "video" else None,
                               frames if item.kind == "video" else None)
            for i, (item, tokens) in enumerate(zip(items, item_tokens))]
    as_ids = req.return_tokens_as_token_ids
    return Work(request, jobs, len(ids) + max_tokens, tokens_as_ids=model.tokens_as_ids if as_ids is None else as_ids,
                prompt_logprobs=req.prompt_logprobs is not None, echo=echo, reasoning=reasoning,
                return_token_ids=req.return_token_ids)


def _held_to(grammar: str, reasoning: ReasoningSplit | None) -> str:
    """The grammar the answer is held to: with a reasoning parser, only the
    content after the reasoning (as vLLM)."""
    return reasoning.grammar(grammar) if reasoning is not None else grammar


def _priority(req, model: ModelInfo) -> int:
    if req.priority and model.scheduling_policy != "priority":
        # vLLM's answer too: a priority means nothing to a first-come, first-served queue.
        raise ApiError(f"priority {req.priority} needs the generators' priority scheduling "
                       "(--scheduling-policy priority)", param="priority")
    return req.priority


def _cache_salt(req) -> str:
    if req.cache_salt == "":   # vLLM refuses it too: an empty salt would read as none
        raise ApiError("cache_salt must be a non-empty string if provided", param="cache_salt")
    return req.cache_salt or ""


def _given(value, defaults: dict, name: str, off):
    """The request's value, else the checkpoint's default, else `off`."""
    return value if value is not None else defaults.get(name, off)


def _check_sampling(s: protocol.Sampling) -> None:
    """The generator checks again; here so a bad value is a 400 at once."""
    SamplingParams(**msgspec.structs.asdict(s))
