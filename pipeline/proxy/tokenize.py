"""/tokenize, /detokenize and /version, in the common servers' shapes."""

from __future__ import annotations

from importlib import metadata

import jinja2
import msgspec
from aiohttp import web

from pipeline.proxy.api_types import ApiError, ChatMessage, check_template_kwargs, decode_json
from pipeline.proxy.requests import ModelInfo, check_template_takes, plain_messages
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


def tokenize_handler(model: ModelInfo):
    async def tokenize(request: web.Request) -> web.Response:
        req = decode_json(await request.read(), TokenizeRequest)
        model.check_name(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise ApiError("send exactly one of 'prompt' and 'messages'", param="prompt")
        if req.prompt is not None:
            tokens = model.processor.tokenizer.encode(req.prompt, req.add_special_tokens is not False)
        else:
            messages, media = plain_messages(req.messages)
            if media:
                raise ApiError("/tokenize takes text messages only (no image_url or video_url parts)",
                               param="messages")
            check_template_kwargs(req.chat_template_kwargs)
            tools = tool_request(req)
            template = model.template_for(req.chat_template)
            check_template_takes(template, tools, messages)
            messages = model.content_for(template, messages, tools.template_tools is not None)
            try:
                text = template.render(messages, add_generation_prompt=req.add_generation_prompt,
                                                       tools=tools.template_tools,
                                                       continue_final_message=req.continue_final_message,
                                                       **model.template_kwargs_for(req.chat_template_kwargs))
            except (ValueError, jinja2.TemplateError) as exc:
                raise ApiError(f"cannot build the prompt: {exc}", param="messages") from None
            tokens = model.processor.tokenizer.encode(text, bool(req.add_special_tokens))
        body = {"count": len(tokens), "max_model_len": model.max_context, "tokens": tokens}
        if req.return_token_strs:
            body["token_strs"] = [model.processor.tokenizer.token_text(t) for t in tokens]
        return web.json_response(body)

    return tokenize


def detokenize_handler(model: ModelInfo):
    async def detokenize(request: web.Request) -> web.Response:
        req = decode_json(await request.read(), DetokenizeRequest)
        model.check_name(req.model)
        vocab = model.processor.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in req.tokens):
            raise ApiError(f"token ids must be in [0, {vocab})", param="tokens")
        return web.json_response({"prompt": model.processor.tokenizer.decode(req.tokens, skip_special_tokens=False)})

    return detokenize
