"""The bodies of whole (not streamed) answers and of failed requests."""

from __future__ import annotations

import time

from aiohttp import web

from pipeline import protocol
from pipeline.proxy.api_types import ApiError


def error_response(delta: protocol.TokenDelta) -> web.Response:
    """A request that ended in failure (already counted by the dispatcher)."""
    status = delta.status or 500
    error = ApiError(delta.error, status=status, kind="invalid_request_error" if status < 500 else "server_error")
    return web.json_response(error.body(), status=status)


def usage_of(delta: protocol.TokenDelta) -> dict:
    return {"prompt_tokens": delta.prompt_tokens, "completion_tokens": delta.completion_tokens,
            "total_tokens": delta.prompt_tokens + delta.completion_tokens}


def response_body(rid, model_id, text, last, chat) -> dict:
    choice = {"index": 0, "finish_reason": last.finish_reason, "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model_id, "choices": [choice], "usage": usage_of(last)}
