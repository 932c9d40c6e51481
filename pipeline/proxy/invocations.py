"""SageMaker's `POST /invocations`, as `vllm serve` has it: one route for
either API, told apart by the body (behind `--api-key` like `/v1/*`)."""

from __future__ import annotations

import msgspec
from aiohttp import web

from pipeline.proxy.api_types import ApiError, decode_json


class _InvocationKind(msgspec.Struct):
    """Which fields a body has, read as they are (empty: absent)."""
    messages: msgspec.Raw = msgspec.Raw()
    prompt: msgspec.Raw = msgspec.Raw()


def invocations_handler(app):
    """The handler over `app` (a ProxyApp): chat if the body has `messages`,
    a text completion if it has `prompt`."""

    async def invocations(request: web.Request) -> web.StreamResponse:
        kind = decode_json(await request.read(), _InvocationKind)   # aiohttp keeps the body for the handler
        if bytes(kind.messages) not in (b"", b"null"):
            return await app.chat(request)
        if bytes(kind.prompt) not in (b"", b"null"):
            return await app.completions(request)
        raise ApiError("/invocations takes a chat (messages) or a text completion (prompt) body",
                       param="messages")

    return invocations
