"""The Responses API's routes: `POST /v1/responses` (whole, streamed, or
in the background: responses_background.py), `GET` and `DELETE
/v1/responses/{id}`, `GET /v1/responses/{id}/input_items`, and
`POST /v1/responses/{id}/cancel` (of a background response).

A request is served as the chat request it reads as
(responses_request.py), through the app's own serving: the same dispatch,
failover, client-gone aborts, metrics and logs as a chat completion.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from aiohttp import web

from pipeline.proxy.access import ARRIVED_KEY, MODEL_NAME_KEY, PARSE_TOOLS_KEY, REQUEST_ID_KEY, echo_request_id
from pipeline.proxy.api_types import ApiError
from pipeline.proxy.logprobs_format import chat_logprobs, entries_of
from pipeline.proxy.requests import chat_work
from pipeline.proxy.responses import ChatDeltas, error_response
from pipeline.proxy.responses_input_items import input_items_of, input_items_page
from pipeline.proxy.responses_output import (ResponseEvents, finished, new_id, output_of, reasoning_tokens,
                                             response_object)
from pipeline.proxy.responses_replay import send_log, sse, starting_after
from pipeline.proxy.responses_request import chat_request, conversation_of, parse_responses_body, wants_logprobs
from pipeline.proxy.tools import tool_request


class ResponsesEndpoints:
    """ProxyApp's Responses API (a mixin: it uses the app's model, dispatcher,
    serving, delta reader and `responses` store)."""

    def responses_routes(self) -> list:
        return [web.post("/v1/responses", self.create_response),
                web.get("/v1/responses/{response_id}", self.get_response),
                web.delete("/v1/responses/{response_id}", self.delete_response),
                web.get("/v1/responses/{response_id}/input_items", self.list_input_items),
                web.post("/v1/responses/{response_id}/cancel", self.cancel_response)]

    async def create_response(self, request: web.Request) -> web.StreamResponse:
        req = parse_responses_body(await request.read())
        request[MODEL_NAME_KEY] = self.model.check_name(req.model)
        turns = self._history(req.previous_response_id) + conversation_of(req.input)
        chat = chat_request(req, turns, self.model.max_context)
        work = await chat_work(chat, self.model, self.policy, "resp-" + self.dispatcher.new_request_id(),
                               self.dispatcher.address, self.session)
        work.arrived, work.client_id = request[ARRIVED_KEY], request[REQUEST_ID_KEY]
        request[PARSE_TOOLS_KEY] = tool_request(chat).parses
        answer = ResponsesAnswer(self, req, work, turns, request[PARSE_TOOLS_KEY], request[MODEL_NAME_KEY])
        if req.background:
            if self.stopping:
                raise ApiError("the server stopped before this request was sent on", status=503)
            queued = self.background.start(answer, work, input_items_of(req.input), request[MODEL_NAME_KEY],
                                           req.stream)
            if req.stream:
                return await send_log(request, self.background.logs.get(queued), -1)
            return web.json_response(queued)
        return await self._serve(request, chat, work, chat=True, answer=answer)

    async def get_response(self, request: web.Request) -> web.StreamResponse:
        """The stored response; with `stream=true`, a streamed background
        response's events after `starting_after` (responses_replay.py).
        `include_obfuscation` is accepted either way: no event carries
        obfuscation padding here."""
        stream = request.query.get("stream", "false").lower()
        if stream not in ("true", "false"):
            raise ApiError(f"stream must be true or false (got {request.query['stream']!r})", param="stream")
        if "include" in request.query or "include[]" in request.query:
            raise ApiError("include: a stored response is returned as it was made; ask for include when "
                           "creating it", param="include")
        stored = self._stored(request)
        if stream == "false":
            if "starting_after" in request.query:
                raise ApiError("starting_after needs stream=true", param="starting_after")
            return web.json_response(stored.response)
        after = starting_after(request.query)
        return await send_log(request, self.background.logs.get(stored.response), after)

    async def delete_response(self, request: web.Request) -> web.Response:
        stored = self._stored(request)
        await self._stop_background(stored.response["id"])
        self.responses.pop(stored.response["id"])
        self.background.logs.drop(stored.response["id"])
        return web.json_response({"id": stored.response["id"], "object": "response", "deleted": True})

    async def list_input_items(self, request: web.Request) -> web.Response:
        return web.json_response(input_items_page(self._stored(request).input_items, request.query))

    async def cancel_response(self, request: web.Request) -> web.Response:
        """A background response, stopped if it still runs (one that ended
        is answered as it ended, as OpenAI's API does)."""
        stored = self._stored(request)
        if not stored.response.get("background"):
            raise ApiError("Cannot cancel a synchronous response.", param="response_id")
        await self._stop_background(stored.response["id"])
        return web.json_response(self._stored(request).response)

    async def _stop_background(self, response_id: str) -> None:
        await self.background.cancel(response_id)

    def _stored(self, request: web.Request):
        response_id = request.match_info["response_id"]
        found = self.responses.get(response_id)
        if found is None:
            raise _not_found(response_id, "response_id")
        return found

    def _history(self, response_id: str | None) -> list[dict]:
        if response_id is None:
            return []
        found = self.responses.get(response_id)
        if found is None:
            raise _not_found(response_id, "previous_response_id")
        if found.response["status"] not in ("completed", "incomplete"):
            raise ApiError(f"Response with id '{response_id}' is {found.response['status']}: only a finished "
                           "response can be gone on from", param="previous_response_id")
        return [dict(message) for message in found.conversation]


def _not_found(response_id: str, param: str) -> ApiError:
    return ApiError(f"Response with id '{response_id}' not found.", status=404, param=param)


class ResponsesAnswer:
    """How ProxyApp._serve answers one Responses request: whole, or as events."""

    def __init__(self, app, req, work, turns: list[dict], tools: bool, model_name: str) -> None:
        self.app, self.req, self.turns, self.tools = app, req, turns, tools
        self.logprobs = wants_logprobs(req)
        split = work.reasoning
        self.end_id = split.end_id if split is not None and not split.all_content else None
        self.response = response_object(new_id("resp"), int(time.time()), model_name, req, work.request.sampling,
                                        stored=req.store and app.responses.enabled)

    async def whole(self, request: web.Request, flight, delta) -> web.Response:
        last, body = await self.finished_body(request, flight, delta)
        return error_response(last) if body is None else web.json_response(body)

    async def finished_body(self, request, flight, delta) -> tuple:
        """Read the flight to its end: (its last delta, the whole response,
        stored if asked; None if it failed). `request`: an HTTP request, or
        a mapping with its model name and tool parsing (a background run)."""
        last, choice = await self.app._choice(request, flight, delta, True)
        if last.error:
            return last, None
        logprobs = choice["logprobs"]["content"] if self.logprobs else None
        body = finished(self.response, output_of(choice["message"], logprobs), last,
                        reasoning_tokens(flight.token_ids, self.end_id))
        self._keep(body)
        return last, body

    async def open(self, request: web.Request):
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        echo_request_id(request, response)
        await response.prepare(request)
        events = ResponseEvents(self.response, self.logprobs)
        await _send(response, events.opening())
        return response, events

    async def stream(self, opened, flight, delta) -> web.StreamResponse:
        response, events = opened
        async for out in self.events_of(events, flight, delta):
            await _send(response, out)
        await response.write_eof()
        return response

    async def events_of(self, events: ResponseEvents, flight, delta) -> AsyncIterator[list[dict]]:
        """The flight's deltas, from `delta` on, as lists of events, to the
        one that ends it (response.completed, or response.failed: the last
        delta's `error` says which)."""
        deltas = ChatDeltas(self.tools, flight.work.reasoning)
        while True:
            if delta.error:
                yield events.failed(delta.error, delta.status or 500)
                return
            entries = (chat_logprobs(self.app.token_names(flight), entries_of(delta))["content"]
                       if self.logprobs else None)
            yield events.piece(deltas.delta(delta.text, delta.finished), entries)
            if delta.finished:
                out, whole = events.closing(delta, reasoning_tokens(flight.token_ids, self.end_id))
                self._keep(whole)   # before the last event goes: it says whether it was stored
                yield out
                return
            delta = await self.app._next(flight)

    def _keep(self, body: dict) -> None:
        """Store the answer with its conversation, if asked and it fits."""
        kept = False
        if self.req.store and self.app.responses.enabled:
            kept = self.app.responses.put(body, self.turns + [_as_message(body["output"])],
                                          input_items_of(self.req.input))
        body["store"] = kept


def _as_message(output: list[dict]) -> dict:
    """An answer's output items as the assistant message the next turn's
    prompt renders (its reasoning left out, as the templates leave it)."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    message = {"role": "assistant", "content": text}
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    if calls:
        message["tool_calls"] = calls
    return message


async def _send(response: web.StreamResponse, events: list[dict]) -> None:
    if events:
        await response.write(b"".join(map(sse, events)))
