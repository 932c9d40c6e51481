"""Background responses (`background: true`, as OpenAI's API and vLLM serve
them): the request is answered at once with the response `queued`, and the
answer is made in the proxy meanwhile; `GET /v1/responses/{id}` reads
where it is and `POST /v1/responses/{id}/cancel` stops it.

- It needs `store` (the answer is read back from the store).
- With `stream` too, the POST is answered with the response's events as
  they are made (response.created and response.queued first, then
  response.in_progress once its generator has answered), kept in an event
  log from which a dropped client resumes (responses_replay.py).
- Its status: `queued`, `in_progress` once its generator has answered,
  then `completed` or `incomplete` (as a response answered at once),
  `failed` (with its error) or `cancelled`.
- It counts as a request being handled, so a stopping proxy's drain waits
  for it as for any other, and one still running when the drain ends is
  `failed`, not lost.
- Until it is done it is no `previous_response_id` (a 400): the
  conversation it would go on from has no answer yet.
"""

from __future__ import annotations

import asyncio
import logging

from pipeline.proxy.access import MODEL_NAME_KEY, PARSE_TOOLS_KEY
from pipeline.proxy.api_types import ApiError
from pipeline.proxy.responses_output import ResponseEvents
from pipeline.proxy.responses_replay import EventLog, EventLogs

log = logging.getLogger("epd.proxy")


class BackgroundRuns:
    """The background responses of one app, by response id."""

    def __init__(self, app) -> None:
        self.app = app
        # Each running one's task, and what stores it: (its answer, its input items).
        self.tasks: dict[str, tuple[asyncio.Task, object, list]] = {}
        self.logs = EventLogs()   # the events of those made with stream

    def start(self, answer, work, input_items: list, model_name: str, stream: bool = False) -> dict:
        """Queue it: stored as `queued` and run by a task of its own; the
        queued response object, to answer the request with (with `stream`,
        its events go to self.logs too)."""
        if not (answer.req.store and self.app.responses.enabled):
            raise ApiError("background responses must be stored: leave store on (and the server's "
                           "--responses-store-mb above 0)", param="background")
        answer.response = {**answer.response, "background": True}
        rid = answer.response["id"]
        queued = self._set(answer, input_items, "queued")
        streamed = None
        if stream:
            streamed = (self.logs.new(rid), ResponseEvents(answer.response, answer.logprobs))
            streamed[0].add(streamed[1].queued(queued))
        self.app.handling += 1   # the drain waits for it
        task = asyncio.create_task(self._run(answer, work, input_items,
                                             {MODEL_NAME_KEY: model_name, PARSE_TOOLS_KEY: answer.tools},
                                             streamed))
        self.tasks[rid] = (task, answer, input_items)
        task.add_done_callback(lambda _: self._ended(rid))
        return queued

    async def cancel(self, response_id: str) -> None:
        """Stop a running one, stored as `cancelled` at once (its task may not
        have begun, and then no line of it runs); back once its task is over."""
        found = self.tasks.get(response_id)
        if found is None:
            return
        task, answer, input_items = found
        if not task.done():
            self._set(answer, input_items, "cancelled")
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def _run(self, answer, work, input_items: list, request_like: dict,
                   streamed: tuple[EventLog, ResponseEvents] | None) -> None:
        rid = answer.response["id"]
        try:
            flight = self.app.dispatcher.submit(work)
            first = await self.app._next(flight)
            if not first.finished:
                self._set(answer, input_items, "in_progress")
            if streamed is not None:
                error = await self._stream(answer, flight, first, *streamed)
            else:
                last, body = await answer.finished_body(request_like, flight, first)
                error = last.error if body is None else None
            if error is not None:
                self._failed(answer, input_items, error)
        except asyncio.CancelledError:   # cancel() stored it as cancelled
            self._abort(work)
            if streamed is not None:
                streamed[0].add(streamed[1].cut())
        except Exception as exc:   # a bug here must not leave it in_progress for ever
            log.exception("background response %s failed", rid)
            self._abort(work)
            message = f"internal error: {type(exc).__name__}"
            self._failed(answer, input_items, message)
            if streamed is not None:
                streamed[0].add(streamed[1].failed(message, 500))

    @staticmethod
    async def _stream(answer, flight, first, events_log: EventLog, events: ResponseEvents) -> str | None:
        """Write the answer's events to its log; the error it failed with, if it did."""
        events_log.add(events.in_progress())
        out: list[dict] = []
        async for out in answer.events_of(events, flight, first):
            events_log.add(out)
        last = out[-1] if out else None
        return last["response"]["error"]["message"] if last and last["type"] == "response.failed" else None

    def _abort(self, work) -> None:
        if self.app.dispatcher.abort(work.request.request_id):
            log.info("background response stopped: its generator was told to drop %s", work.request.request_id)

    def _failed(self, answer, input_items: list, message: str) -> None:
        self._set(answer, input_items, "failed", error={"code": "server_error", "message": message})

    def _set(self, answer, input_items: list, status: str, **fields) -> dict:
        body = {**answer.response, "status": status, **fields}
        self.app.responses.put(body, answer.turns, input_items)
        return body

    def _ended(self, rid: str) -> None:
        self.tasks.pop(rid, None)
        self.logs.ended(rid)
        self.app.handling -= 1
