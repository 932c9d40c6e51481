"""From an OpenAI request to the work the stages do: fetch and check each
image, render and tokenize the prompt, hash the images, fill the sampling
settings, check the context length."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from pipeline import protocol
from pipeline.hashing import content_hash
from pipeline.processing.image import ImageDecodeError, check_source_size, read_image_size
from pipeline.processing.processor import Processor
from pipeline.proxy.api_types import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    image_url_of,
    stop_strings,
)
from pipeline.proxy.dispatcher import Work
from pipeline.proxy.media_fetch import FetchPolicy, fetch_image


@dataclass(frozen=True)
class ModelInfo:
    model_id: str
    processor: Processor
    max_context: int
    salt: bytes
    aggregated: bool = False   # generators encode images themselves: they get the bytes
    max_images: int = 16


async def chat_work(req: ChatCompletionRequest, model: ModelInfo, policy: FetchPolicy, request_id: str,
                    reply_to: str, session=None) -> Work:
    messages, urls = _plain_messages(req)
    if len(urls) > model.max_images:
        raise ApiError(f"too many images: {len(urls)} (at most {model.max_images} per request)", param="messages")
    images = await asyncio.gather(*(fetch_image(u, policy, session) for u in urls))
    sizes = [_checked_size(i, data, model) for i, data in enumerate(images, start=1)]
    try:
        # Inline, not in a thread: rendering and tokenizing a prompt takes far
        # less than a thread hop costs under the GIL.
        prompt = model.processor.chat_prompt(messages, sizes)
    except ValueError as exc:
        raise ApiError(f"cannot build the prompt: {exc}", param="messages") from None
    return _work(req, model, request_id, reply_to, prompt.token_ids, prompt.image_spans, prompt.grids, images)


async def completion_work(req: CompletionRequest, model: ModelInfo, request_id: str, reply_to: str) -> Work:
    if isinstance(req.prompt, str):
        ids = model.processor.tokenizer.encode(req.prompt)
    else:
        ids = list(req.prompt)
        vocab = model.processor.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ApiError(f"prompt token ids must be in [0, {vocab})", param="prompt")
    if not ids:
        raise ApiError("the prompt is empty", param="prompt")
    return _work(req, model, request_id, reply_to, ids, [], [], [])


def _plain_messages(req: ChatCompletionRequest) -> tuple[list[dict], list[str]]:
    """Messages as the chat template expects them, and the image URLs in order."""
    messages, urls = [], []
    for m in req.messages:
        if m.content is None or isinstance(m.content, str):
            messages.append({"role": m.role, "content": m.content or ""})
            continue
        parts = []
        for part in m.content:
            if part.type == "text":
                parts.append({"type": "text", "text": part.text or ""})
            elif part.type == "image_url":
                urls.append(image_url_of(part))
                parts.append({"type": "image"})
            else:
                raise ApiError(f"unsupported content part type {part.type!r}", param="messages")
        messages.append({"role": m.role, "content": parts})
    return messages, urls


def _checked_size(number: int, data: bytes, model: ModelInfo) -> tuple[int, int]:
    """The image's size from its header alone; a bad or oversized image is a 400."""
    try:
        height, width = read_image_size(data)
        check_source_size(height, width, model.processor.image_config)
    except ImageDecodeError as exc:
        raise ApiError(f"image {number}: {exc}", param="messages") from None
    return height, width


def _work(req, model: ModelInfo, request_id: str, reply_to: str, ids: list[int], spans, grids,
          images: list[bytes]) -> Work:
    room = model.max_context - len(ids)
    max_tokens = req.max_completion_tokens or req.max_tokens or room
    if max_tokens < 1 or len(ids) + max_tokens > model.max_context:
        raise ApiError(f"This model's maximum context length is {model.max_context} tokens. However, you "
                       f"requested {len(ids) + max_tokens} tokens ({len(ids)} in the messages, {max_tokens} "
                       "in the completion). Please reduce the length of the messages or completion.",
                       param="max_tokens")
    try:
        sampling = protocol.Sampling(
            max_tokens=max_tokens, min_tokens=req.min_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_k=req.top_k or 0, top_p=1.0 if req.top_p is None else req.top_p, seed=req.seed,
            stop=stop_strings(req.stop), ignore_eos=req.ignore_eos)
        _check_sampling(sampling)
    except ValueError as exc:
        raise ApiError(str(exc)) from None
    keys = tuple(content_hash(data, model.salt) for data in images)
    # In EPD mode pixels never go to a generator: encoders hand it embeddings.
    media = tuple(images) if model.aggregated else ()
    request = protocol.GenerateRequest(request_id, tuple(ids), tuple(spans), keys, tuple(grids), sampling,
                                       reply_to, media)
    jobs = [protocol.EncodeJob(f"{request_id}/{i}", request_id, key, data, "", length, reply_to)
            for i, (key, data, (_, length)) in enumerate(zip(keys, images, spans))]
    return Work(request, jobs, len(ids) + max_tokens)


def _check_sampling(s: protocol.Sampling) -> None:
    """The generator checks again; here so a bad value is a 400 at once."""
    from pipeline.engine.request import SamplingParams

    SamplingParams(s.max_tokens, s.min_tokens, s.temperature, s.top_k, s.top_p, s.seed, s.stop_token_ids,
                   s.stop, s.ignore_eos)
