"""/tokenize, /detokenize and /version, in the common servers' shapes."""

from __future__ import annotations

from importlib import metadata

import jinja2
import msgspec
from aiohttp import web

from pipeline.proxy.api_types import (
    ApiError,
    ChatMessage,
    MediaProcessorKwargs,
    check_template_kwargs,
    decode_json,
)
from pipeline.proxy.requests import ModelInfo, chat_media, check_template_takes, plain_messages
from pipeline.proxy.tools import tool_request


class TokenizeRequest(msgspec.Struct):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None   # vLLM's defaults: true for a prompt, false for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None     # as on chat completions (ModelInfo.template_for)
    tools: list | None = None            # function definitions for the chat template
    chat_template_kwargs: dict[str, object] | None = None   # more template variables, as on chat completions
    return_token_strs: bool = False      # vLLM's: the tokens' strings too
    mm_processor_kwargs: MediaProcessorKwargs | None = None   # a video's fps or num_frames, as on chat completions


class DetokenizeRequest(msgspec.Struct):
    tokens: list[int]
    model: str | None = None


def version() -> str:
    try:
        return metadata.version("epd")
    except metadata.PackageNotFoundError:   # run from a checkout that was never installed
        return "0+unknown"


async def version_page(request: web.Request) -> web.Response:
    return web.json_response({"version": version()})


def tokenize_handler(app):
    """/tokenize for `app` (a ProxyApp: its model, and its media fetch policy
    and session). A chat's images and videos are fetched and read as a chat
    completion's are: its tokens are the prompt the model sees, each
    placeholder expanded to its media's tokens (vLLM counts each as one)."""
    async def tokenize(request: web.Request) -> web.Response:
        model: ModelInfo = app.model
        req = decode_json(await request.read(), TokenizeRequest)
        model.check_name(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise ApiError("send exactly one of 'prompt' and 'messages'", param="prompt")
        if req.prompt is not None:
            tokens = model.processor.tokenizer.encode(req.prompt, req.add_special_tokens is not False)
        else:
            tokens = await _chat_tokens(req, model, app.policy, app.session)
        body = {"count": len(tokens), "max_model_len": model.max_context, "tokens": tokens}
        if req.return_token_strs:
            body["token_strs"] = [model.processor.tokenizer.token_text(t) for t in tokens]
        return web.json_response(body)

    return tokenize


async def _chat_tokens(req: TokenizeRequest, model: ModelInfo, policy, session) -> list[int]:
    messages, media = plain_messages(req.messages)
    check_template_kwargs(req.chat_template_kwargs)
    tools = tool_request(req)
    template = model.template_for(req.chat_template)
    check_template_takes(template, tools, messages)
    messages = model.content_for(template, messages, tools.template_tools is not None)
    found = await chat_media(media, req, model, policy, session)
    try:
        prompt = model.processor.chat_prompt(messages, found.sizes, found.plans, tools.template_tools,
                                             req.add_generation_prompt, model.template_kwargs_for(
                                                 req.chat_template_kwargs),
                                             req.continue_final_message, bool(req.add_special_tokens),
                                             template=template)
    except (ValueError, jinja2.TemplateError) as exc:
        raise ApiError(f"cannot build the prompt: {exc}", param="messages") from None
    return list(prompt.token_ids)


def detokenize_handler(model: ModelInfo):
    async def detokenize(request: web.Request) -> web.Response:
        req = decode_json(await request.read(), DetokenizeRequest)
        model.check_name(req.model)
        vocab = model.processor.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in req.tokens):
            raise ApiError(f"token ids must be in [0, {vocab})", param="tokens")
        return web.json_response({"prompt": model.processor.tokenizer.decode(req.tokens, skip_special_tokens=False)})

    return detokenize
