"""Who may call the API, and how each call is named: the API key, request
ids, CORS, and the JSON error shape for everything aiohttp itself answers
(unknown routes, wrong methods) or that fails inside a handler."""

from __future__ import annotations

import hmac
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from aiohttp import web

from pipeline.proxy.api_types import ApiError

log = logging.getLogger("epd.proxy")
REQUEST_ID = "X-Request-Id"
MAX_REQUEST_ID = 128   # longer ids sent by clients are replaced by ours
# Per-request storage keys (typed keys where this aiohttp has them, 3.12 on).
_key = getattr(web, "RequestKey", lambda name, kind: name)
REQUEST_ID_KEY = _key("request_id", str)
MODEL_NAME_KEY = _key("model_name", str)   # the model name a response reports
PARSE_TOOLS_KEY = _key("parse_tools", bool)   # whether tool calls are parsed out of the answer
ARRIVED_KEY = _key("arrived", float)   # time.monotonic() as the request came in (TTFT counts from it)


@dataclass(frozen=True)
class AccessPolicy:
    """api_key: None for an open server. The key guards the API routes (/v1/*,
    /tokenize, /detokenize, /invocations); with protect_all, /health, /ping,
    /metrics and /version too."""

    api_key: str | None = None
    protect_all: bool = False
    allowed_origins: Sequence[str] = ("*",)
    allowed_methods: Sequence[str] = ("*",)
    allowed_headers: Sequence[str] = ("*",)
    allow_credentials: bool = False

    def guards(self, path: str) -> bool:
        if self.api_key is None:
            return False
        return self.protect_all or path.startswith("/v1/") or path in ("/tokenize", "/detokenize", "/invocations")


def request_id_of(request: web.Request) -> str:
    """The client's X-Request-Id when it sent a usable one, else a new one."""
    given = request.headers.get(REQUEST_ID, "")
    return given if _usable_id(given) else uuid.uuid4().hex


def _usable_id(text: str) -> bool:
    return bool(text) and len(text) <= MAX_REQUEST_ID and text.isprintable()


def adopt_body_request_id(request: web.Request, body_id: str | None) -> None:
    """vLLM's `request_id` body field names the request where the client
    sent no usable X-Request-Id (the header wins, as in vLLM): the answer's
    id, the echoed header and the log's request_id."""
    if body_id is None:
        return
    if not _usable_id(body_id):
        raise ApiError(f"request_id must be 1 to {MAX_REQUEST_ID} printable characters", param="request_id")
    if not _usable_id(request.headers.get(REQUEST_ID, "")):
        request[REQUEST_ID_KEY] = body_id


def response_id(request: web.Request, chat: bool) -> str:
    """The `id` of an answer, as vLLM names it: chatcmpl- or cmpl- and the
    request's X-Request-Id (the client's, else ours), so that a client can
    find its answer in our logs by the id it sent. Our own routing id stays
    apart from it: two clients may send the same X-Request-Id."""
    return ("chatcmpl-" if chat else "cmpl-") + request[REQUEST_ID_KEY]


def error_middleware(policy: AccessPolicy):
    """Outermost: names the request (X-Request-Id, echoed on every answer),
    checks the key, and turns whatever aiohttp or a handler raised into the
    OpenAI error shape; an internal failure is logged with the request id,
    and its answer says nothing of what failed."""

    @web.middleware
    async def middleware(request: web.Request, handler):
        request[ARRIVED_KEY] = time.monotonic()
        request_id = request_id_of(request)
        request[REQUEST_ID_KEY] = request_id
        try:
            if request.method != "OPTIONS" and policy.guards(request.path) and not _authorised(request, policy):
                raise ApiError("Unauthorized: send the API key as 'Authorization: Bearer <key>'", status=401)
            response = await handler(request)
        except ApiError as exc:
            response = _json_error(exc)
        except web.HTTPException as exc:   # aiohttp's own: no route (404), wrong method (405), body too large
            if exc.status < 400:
                raise
            response = _json_error(ApiError(f"{exc.reason}: {request.method} {request.path}", exc.status))
        except ConnectionResetError:
            # The client hung up (a write found the connection closing): the
            # handler has aborted its request, and aiohttp drops such a
            # connection quietly. Not an internal failure, and no one to answer.
            raise
        except Exception:
            log.exception("request %s (%s %s) failed", request_id, request.method, request.path)
            response = _json_error(ApiError(f"internal server error (request id {request_id})", 500))
        if not response.prepared:   # a stream already sent its headers, with the id (see echo_request_id)
            response.headers[REQUEST_ID] = request[REQUEST_ID_KEY]   # the body's request_id may have named it
        return response

    return middleware


def echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """For a streamed response, whose headers leave before the middleware sees it."""
    response.headers[REQUEST_ID] = request.get(REQUEST_ID_KEY) or request_id_of(request)


def _authorised(request: web.Request, policy: AccessPolicy) -> bool:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), policy.api_key.encode())


def _json_error(exc: ApiError) -> web.Response:
    headers = {"Retry-After": "1"} if exc.status in (429, 503) else None
    return web.json_response(exc.body(), status=exc.status, headers=headers)


def add_cors(app: web.Application, policy: AccessPolicy) -> None:
    """CORS on every route (aiohttp-cors), as the common servers allow by
    default: any origin, method and header unless narrowed."""
    if not policy.allowed_origins:
        return
    import aiohttp_cors

    options = aiohttp_cors.ResourceOptions(allow_credentials=policy.allow_credentials, expose_headers=(REQUEST_ID,),
                                           allow_headers=_star(policy.allowed_headers),
                                           allow_methods=_star(policy.allowed_methods))
    cors = aiohttp_cors.setup(app, defaults={origin: options for origin in policy.allowed_origins})
    for route in list(app.router.routes()):
        cors.add(route)


def _star(values: Sequence[str]):
    return "*" if "*" in values else tuple(values)
