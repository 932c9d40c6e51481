"""The OpenAI-compatible HTTP API (aiohttp): chat and text completions,
streaming (SSE) or not, models, tokenize, version, health, metrics."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import msgspec
from aiohttp import web

from pipeline import protocol
from pipeline.proxy import token_ids
from pipeline.proxy.access import (ARRIVED_KEY, MODEL_NAME_KEY, PARSE_TOOLS_KEY, REQUEST_ID_KEY, AccessPolicy,
                                   add_cors, adopt_body_request_id, echo_request_id, error_middleware, response_id)
from pipeline.proxy.api_types import ApiError, completion_prompts, parse_body
from pipeline.proxy.dispatcher import Dispatcher
from pipeline.proxy.echo import Echo, echoed_completion_logprobs
from pipeline.proxy.fanout import ManyChoices, copies
from pipeline.proxy.flights import Flight, Work
from pipeline.proxy.invocations import invocations_handler
from pipeline.proxy.logprobs_format import (chat_logprobs, completion_logprobs, entries_of, prompt_logprobs,
                                            token_names)
from pipeline.proxy.media_fetch import FetchPolicy, guarded_session
from pipeline.proxy.metrics import ProxyMetrics
from pipeline.proxy.model_cards import model_routes
from pipeline.proxy.request_log import log_aborted, log_finished
from pipeline.proxy.requests import ModelInfo, chat_work, completion_work
from pipeline.proxy.responses import (ChatDeltas, continuous_usage, error_response, final_usage,
                                     prompt_logprobs_at_top, response_body, usage_of)
from pipeline.proxy.responses_endpoint import ResponsesEndpoints
from pipeline.proxy.responses_background import BackgroundRuns
from pipeline.proxy.responses_store import ResponseStore
from pipeline.proxy.tokenize import detokenize_handler, tokenize_handler, version_page
from pipeline.proxy.tools import tool_request

MAX_BODY = 64 << 20
CLIENT_CHECK_S = 1.0     # how often hung-up clients are looked for
CLIENT_GONE = object()   # put in a request's delta queue when its client hung up
DRAIN_POLL_S = 0.05      # how often a stopping proxy looks whether its requests are done

log = logging.getLogger("epd.proxy")
# The routes whose requests /load counts (vLLM's: those that run the model).
LOADED_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/invocations")


class ProxyApp(ManyChoices, ResponsesEndpoints):
    def __init__(self, dispatcher: Dispatcher, model: ModelInfo, policy: FetchPolicy,
                 drain_timeout: float = 30.0, access: AccessPolicy = AccessPolicy(),
                 prompt_tokens_details: bool = False, force_usage: bool = False,
                 responses_store_bytes: int = 64 << 20, load_tracking: bool = False) -> None:
        self.dispatcher = dispatcher
        self.load_tracking = load_tracking   # --enable-server-load-tracking: /load counts generation requests
        self.server_load = 0
        self.prompt_tokens_details = prompt_tokens_details   # usage names the prompt's cached tokens (vLLM's flag)
        self.force_usage = force_usage   # every stream ends with its usage (--enable-force-include-usage)
        self.responses = ResponseStore(responses_store_bytes)   # the Responses API's stored answers
        self.background = BackgroundRuns(self)   # its background responses, while they run
        self.model = model
        self.policy = policy
        self.access = access
        self.drain_timeout = drain_timeout   # on stop, for the requests in flight
        self.handling = 0          # HTTP requests being handled, from parsing to the last byte
        self.stopping = False      # the drain is over: nothing more is sent to the stages
        self.metrics = ProxyMetrics(dispatcher, model.names[0] if model is not None else "",
                                    model.max_context if model is not None else 1)
        dispatcher.on_finish = self._record
        self.session = None
        self._clients: dict[str, tuple[web.Request, Flight]] = {}
        self._client_watch: asyncio.Task | None = None

    def build(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY, middlewares=[error_middleware(self.access), self._errors])
        app.add_routes([web.post("/v1/chat/completions", self.chat), web.post("/v1/completions", self.completions),
                        *model_routes(self.model), web.get("/health", self.health),
                        # SageMaker's routes, as vllm serve has them: a health check, and either API by its body.
                        web.get("/ping", self.health), web.post("/ping", self.health),
                        web.post("/invocations", invocations_handler(self)),
                        web.get("/metrics", self.metrics_page), web.get("/version", version_page),
                        web.get("/load", self.load),
                        web.post("/tokenize", tokenize_handler(self)),
                        web.post("/detokenize", detokenize_handler(self.model)), *self.responses_routes()])
        add_cors(app, self.access)
        app.on_startup.append(self._start)
        app.on_shutdown.append(self._drain)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app) -> None:
        self.dispatcher.start()
        # The port opens after this: a proxy restarted under load would
        # otherwise refuse its first requests ("no generator is available")
        # until the stages' first stats replies arrive. A refused connection
        # is safe for a client to retry; a 503 is not always retried.
        deadline = time.monotonic() + self.dispatcher.stage_timeout
        while not self.dispatcher.healthy() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self._client_watch = asyncio.create_task(self._watch_clients())
        if self.policy.allow_http:
            self.session = guarded_session(self.policy)

    async def _drain(self, app) -> None:
        """Stopping, and no longer listening: the requests being handled get
        `drain_timeout` to finish. Those still running then end with a 503
        their clients can read (an error event in a stream), not a cut
        connection, and their generators stop them."""
        if not self.handling:
            return
        log.info("stopping: %d request(s) in flight may finish", self.handling)
        deadline = time.monotonic() + self.drain_timeout
        while self.handling and time.monotonic() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        if self.handling:
            log.warning("stopping: %d request(s) did not finish within %g s; they end with an error",
                        self.handling, self.drain_timeout)
            self.stopping = True
            self.dispatcher.fail_all("the server stopped before this request finished", 503)

    async def _stop(self, app) -> None:
        if self._client_watch is not None:
            self._client_watch.cancel()
        if self.session is not None:
            await self.session.close()
        await self.dispatcher.close()

    @web.middleware
    async def _errors(self, request, handler):
        """Around every request: counted while handled (the drain waits for
        them), and an ApiError becomes its OpenAI-style JSON response."""
        self.handling += 1
        load = self.load_tracking and request.method == "POST" and request.path.startswith(LOADED_PATHS)
        self.server_load += load
        try:
            return await handler(request)
        except ApiError as exc:
            self.metrics.requests.labels("rejected").inc()
            headers = {"Retry-After": "1"} if exc.status in (429, 503) else None
            return web.json_response(exc.body(), status=exc.status, headers=headers)
        finally:
            self.handling -= 1
            self.server_load -= load

    # ------------------------------------------------------------ endpoints

    async def chat(self, request: web.Request) -> web.StreamResponse:
        req = parse_body(await request.read(), "chat")
        adopt_body_request_id(request, req.request_id)
        request[MODEL_NAME_KEY] = self.model.check_name(req.model)
        rid = "chatcmpl-" + self.dispatcher.new_request_id()
        work = await chat_work(req, self.model, self.policy, rid, self.dispatcher.address, self.session)
        work.arrived, work.client_id = request[ARRIVED_KEY], request[REQUEST_ID_KEY]
        request[PARSE_TOOLS_KEY] = tool_request(req).parses
        if req.n > 1:
            return await self._serve_many(request, req, copies(work, req.n), chat=True)
        return await self._serve(request, req, work, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = parse_body(await request.read(), "completion")
        prompts = completion_prompts(req.prompt)   # a 400 for a bad one, before the model's name (as before)
        adopt_body_request_id(request, req.request_id)
        request[MODEL_NAME_KEY] = self.model.check_name(req.model)
        rid = "cmpl-" + self.dispatcher.new_request_id()
        works = [await completion_work(req, self.model, rid if len(prompts) == 1 else f"{rid}.p{k}",
                                       self.dispatcher.address, prompt) for k, prompt in enumerate(prompts)]
        for work in works:
            work.arrived, work.client_id = request[ARRIVED_KEY], request[REQUEST_ID_KEY]
        if len(works) > 1 or req.n > 1:   # choices prompt by prompt, n each, as vLLM numbers them
            return await self._serve_many(request, req, [c for w in works for c in copies(w, req.n)], chat=False)
        return await self._serve(request, req, works[0], chat=False)

    async def health(self, request: web.Request) -> web.Response:
        if self.dispatcher.healthy():
            return web.json_response({"status": "ok"})
        down = [a for a in self.dispatcher.generators + self.dispatcher.encoders if not self.dispatcher.up(a)]
        return web.json_response({"status": "unavailable", "down": down}, status=503)

    async def load(self, request: web.Request) -> web.Response:
        """vLLM's /load: the generation requests being handled, with
        --enable-server-load-tracking (0 without it, as vLLM answers)."""
        return web.json_response({"server_load": self.server_load})

    async def metrics_page(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), content_type="text/plain")

    # -------------------------------------------------------------- serving

    async def _serve(self, request: web.Request, req, work, chat: bool, answer=None) -> web.StreamResponse:
        """answer: how the answer is shaped (a ResponsesAnswer), if not as a chat or text completion."""
        if self.stopping:    # it was still reading its images when the drain ended
            raise ApiError("the server stopped before this request was sent on", status=503)
        flight = self.dispatcher.submit(work)
        rid = work.request.request_id
        self._clients[rid] = (request, flight)
        try:
            if req.stream and not work.jobs:
                # Text only: nothing about the input can be rejected from here
                # on, so the headers and the role chunk go out while the
                # generator works instead of after its first token.
                stream = await self._open(request, chat, answer, work)
                return await self._streamed(stream, req, flight, await self._next(flight), answer)
            first = await self._next(flight)
            if first.finished and first.error:
                return error_response(first)   # e.g. a bad image: a 4xx, not a broken stream
            if req.stream:
                return await self._streamed(await self._open(request, chat, answer, work), req, flight, first, answer)
            if answer is not None:
                return await answer.whole(request, flight, first)
            return await self._whole(request, flight, first, chat)
        except (asyncio.CancelledError, ConnectionResetError):
            if self.dispatcher.abort(rid):    # still live: nothing has counted its tokens
                self.metrics.generated(flight.tokens)
                log_aborted(flight, time.monotonic())
            self.metrics.requests.labels("aborted").inc()
            raise
        except BaseException:
            self.dispatcher.abort(rid)   # a failure here (a 500): its generator must not run on
            raise
        finally:
            self._clients.pop(rid, None)

    async def _open(self, request, chat: bool, answer, work: Work):
        return await (answer.open(request) if answer is not None else self._open_stream(request, chat, work))

    async def _streamed(self, opened, req, flight, delta, answer):
        if answer is not None:
            return await answer.stream(opened, flight, delta)
        return await self._stream(opened, req, flight, delta)

    async def _next(self, flight: Flight) -> protocol.TokenDelta:
        delta = await flight.deltas.get()
        if delta is CLIENT_GONE:
            raise ConnectionResetError("client disconnected")
        return delta

    async def _watch_clients(self) -> None:
        """One loop for all requests finds clients that hung up, so that
        waiting for a delta needs no timeout (a timer per token costs)."""
        while True:
            await asyncio.sleep(CLIENT_CHECK_S)
            for rid, (request, flight) in list(self._clients.items()):
                if request.transport is None or request.transport.is_closing():
                    del self._clients[rid]
                    flight.deltas.put_nowait(CLIENT_GONE)

    async def _whole(self, request, flight, delta, chat):
        last, choice = await self._choice(request, flight, delta, chat)
        if last.error:
            return error_response(last)
        body = response_body(response_id(request, chat), request[MODEL_NAME_KEY], "", last, chat,
                             details=self.prompt_tokens_details)
        body["choices"] = [choice]
        token_ids.add_to_whole(body, [flight], chat)
        return web.json_response(prompt_logprobs_at_top(body) if chat else body)

    async def _choice(self, request, flight, delta, chat) -> tuple[protocol.TokenDelta, dict]:
        """Read a flight to its end: (its last delta, its choice of the answer)."""
        text, last, entries, prompt_entries = delta.text, delta, entries_of(delta), delta.prompt_logprobs
        while not last.finished:
            last = await self._next(flight)
            text += last.text
            entries += entries_of(last)
            prompt_entries = prompt_entries or last.prompt_logprobs
        choice = response_body("", request[MODEL_NAME_KEY], text, last, chat, request.get(PARSE_TOOLS_KEY, False),
                               reasoning=flight.work.reasoning)["choices"][0]
        if flight.work.request.sampling.logprobs is not None:
            name = self.token_names(flight)
            choice["logprobs"] = chat_logprobs(name, entries) if chat else completion_logprobs(name, entries)
        if flight.work.prompt_logprobs:
            choice["prompt_logprobs"] = prompt_logprobs(self.token_names(flight), prompt_entries)
        if flight.work.echo is not None:
            self._echo_whole(choice, flight, prompt_entries, chat)
        return last, choice

    def _echo_whole(self, choice: dict, flight: Flight, prompt_entries, chat: bool) -> None:
        echo = flight.work.echo
        if chat:
            if echo.text:
                choice["message"]["content"] = echo.text + (choice["message"]["content"] or "")
            return
        choice["text"] = echo.text + choice["text"]
        if choice["logprobs"] is not None:
            choice["logprobs"] = echoed_completion_logprobs(self.token_names(flight), echo, prompt_entries,
                                                            choice["logprobs"])

    async def _open_stream(self, request, chat, work: Work) -> _Stream:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        echo_request_id(request, response)
        await response.prepare(request)
        stream = _Stream(response, response_id(request, chat), request[MODEL_NAME_KEY], int(time.time()), chat,
                         tools=request.get(PARSE_TOOLS_KEY, False))
        if chat:
            await stream.send(token_ids.add_to_role_chunk(stream.chunk({"role": "assistant", "content": ""}, None),
                                                          work))
        return stream

    async def _stream(self, stream: _Stream, req, flight, delta):
        deltas = ChatDeltas(stream.tools, flight.work.reasoning)
        echo = await self._open_echo(stream, flight, 0)   # a text completion's, sent with the first piece
        ids = token_ids.StreamedIds(flight, stream.chat)
        while True:
            if delta.error:
                await stream.send(ApiError(delta.error, delta.status or 500).body())
                break
            text = (echo.text if echo else "") + delta.text
            payload = deltas.delta(delta.text, delta.finished) if stream.chat else text
            ids.hold(delta.token_ids)
            if (payload if deltas.parses else text) or delta.finished or delta.logprobs:
                chunk = stream.chunk(payload, deltas.finish_reason(delta.finish_reason) or None, delta.stop_reason)
                if flight.work.request.sampling.logprobs is not None:
                    chunk["choices"][0]["logprobs"], stream.text_offset = self.piece_logprobs(
                        stream.chat, flight, delta, stream.text_offset, echo)
                if continuous_usage(req):
                    chunk["usage"] = usage_of(delta)
                await stream.send(ids.attach(chunk))
                echo = None
            if delta.finished:
                if final_usage(req, self.force_usage):
                    usage = stream.chunk(None, None)
                    usage["choices"], usage["usage"] = [], usage_of(delta, self.prompt_tokens_details)
                    await stream.send(usage)
                break
            delta = await self._next(flight)
        await stream.response.write(b"data: [DONE]\n\n")
        await stream.response.write_eof()
        return stream.response

    def token_names(self, flight: Flight):
        """How this flight's logprobs name tokens (logprobs_format.token_names)."""
        return token_names(self.model.processor.tokenizer, flight.work.tokens_as_ids)

    def piece_logprobs(self, chat: bool, flight: Flight, delta: protocol.TokenDelta, offset: int,
                       echo: Echo | None = None) -> tuple[dict, int]:
        """A streamed piece's logprobs, and where the next piece's text starts
        (the completions API counts offsets from the start: the echo's first)."""
        name = self.token_names(flight)
        if chat:
            return chat_logprobs(name, entries_of(delta)), offset
        found = completion_logprobs(name, entries_of(delta), offset)
        if echo is not None:
            found = echoed_completion_logprobs(name, echo, delta.prompt_logprobs, found)
        return found, offset + sum(len(t) for t in found["tokens"])

    async def _open_echo(self, stream: _Stream, flight: Flight, index: int) -> Echo | None:
        """A streamed answer's echo: chat's goes out now, as a content chunk
        of its own after the role; a text completion's is returned, to go
        out with the first piece of the answer."""
        echo = flight.work.echo
        if echo is None or not stream.chat:
            return echo
        if echo.text:
            chunk = stream.chunk({"content": echo.text}, None)
            chunk["choices"][0]["index"] = index
            await stream.send(chunk)
        return None

    def _record(self, flight: Flight, delta: protocol.TokenDelta) -> None:
        now = time.monotonic()
        self.metrics.finished(flight, delta, now)
        log_finished(flight, delta, now)


@dataclass
class _Stream:
    """One server-sent-events response and what every chunk of it repeats."""

    response: web.StreamResponse
    rid: str
    model_id: str
    created: int
    chat: bool
    text_offset: int = 0   # the completions API's logprobs count characters from the start
    tools: bool = False    # tool calls are parsed out of the chat text

    def chunk(self, payload, finish_reason, stop_reason: str | int | None = None) -> dict:
        choice = {"index": 0, "finish_reason": finish_reason, "stop_reason": stop_reason, "logprobs": None}
        if self.chat:
            choice["delta"] = payload or {}
        else:
            choice["text"] = payload or ""
        return {"id": self.rid, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model_id, "choices": [choice]}

    async def send(self, body: dict) -> None:
        await self.response.write(b"data: " + msgspec.json.encode(body) + b"\n\n")
