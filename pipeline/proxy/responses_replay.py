"""The events of a streamed background response (`background` and `stream`
both true), kept so that a client whose connection dropped can pick the
stream up again, as OpenAI's API lets it:
`GET /v1/responses/{id}?stream=true&starting_after=N` sends the events
after sequence number N, then follows the live ones to the end.

An event's sequence number is its place in the log (ResponseEvents numbers
them from 0), so a reader resumes by index. The POST that made the response
is one more reader from the start; its going away stops nothing (the run
is the background task's). Logs of ended runs are kept for the last
KEPT_ENDED of them, and dropped with their response (DELETE).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import AsyncIterator

import msgspec
from aiohttp import web

from pipeline.proxy.access import echo_request_id
from pipeline.proxy.api_types import ApiError

KEPT_ENDED = 64


class EventLog:
    """One response's events in order; readers wait for more until it ends."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self.ended = False
        self._more = asyncio.Event()   # replaced on every change; readers wait on the one they saw

    def add(self, events: list[dict]) -> None:
        for expected, event in enumerate(events, len(self.events)):
            if event["sequence_number"] != expected:
                raise ValueError(f"event {event['sequence_number']} out of order (expected {expected})")
        self.events += events
        self._wake()

    def end(self) -> None:
        self.ended = True
        self._wake()

    async def after(self, sequence_number: int) -> AsyncIterator[dict]:
        """The events after `sequence_number` (-1: all), then each new one,
        until the log ends."""
        at = sequence_number + 1
        while True:
            if at < len(self.events):
                yield self.events[at]
                at += 1
            elif self.ended:
                return
            else:
                await self._more.wait()

    def _wake(self) -> None:
        more, self._more = self._more, asyncio.Event()
        more.set()


class EventLogs:
    """The logs of one app's streamed background responses, by id."""

    def __init__(self) -> None:
        self._logs: OrderedDict[str, EventLog] = OrderedDict()

    def new(self, response_id: str) -> EventLog:
        log = self._logs[response_id] = EventLog()
        return log

    def ended(self, response_id: str) -> None:
        """The run is over: its log is kept among the last KEPT_ENDED."""
        log = self._logs.get(response_id)
        if log is None:
            return
        log.end()
        self._logs.move_to_end(response_id)
        ended = [rid for rid, kept in self._logs.items() if kept.ended]
        for rid in ended[:max(0, len(ended) - KEPT_ENDED)]:
            del self._logs[rid]

    def drop(self, response_id: str) -> None:
        log = self._logs.pop(response_id, None)
        if log is not None:
            log.end()   # a reader still following it stops

    def get(self, response: dict) -> EventLog:
        """The log of a stored response, or a 400 saying why there is none."""
        rid = response["id"]
        log = self._logs.get(rid)
        if log is not None:
            return log
        if not response.get("background"):
            raise ApiError(f"Response '{rid}' was not made in the background: only a background response "
                           "made with stream true can be streamed again; GET it without stream", param="stream")
        raise ApiError(f"Response '{rid}' has no events to stream: it was made without stream, or it ended "
                       f"before the last {KEPT_ENDED} streamed ones; GET it without stream", param="stream")


def starting_after(query) -> int:
    """The `starting_after` query parameter: a sequence number, or -1 (all) when absent."""
    text = query.get("starting_after")
    if text is None:
        return -1
    try:
        value = int(text)
    except ValueError:
        value = -2
    if value < 0:
        raise ApiError(f"starting_after must be a non-negative integer (got {text!r})", param="starting_after")
    return value


async def send_log(request: web.Request, log: EventLog, after: int) -> web.StreamResponse:
    """Serve the log's events after `after` as server-sent events, to its
    end or until the client goes."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    echo_request_id(request, response)
    await response.prepare(request)
    try:
        async for event in log.after(after):
            await response.write(sse(event))
        await response.write_eof()
    except ConnectionResetError:
        pass   # the reader went; the run goes on in the background (a cancelled handler too)
    return response


def sse(event: dict) -> bytes:
    """One event as a server-sent event, named by its type."""
    return b"event: " + event["type"].encode() + b"\ndata: " + msgspec.json.encode(event) + b"\n\n"
