"""Streamed background responses (`background` and `stream` both true) and
resuming their streams (`GET /v1/responses/{id}?stream=true&starting_after=N`),
through the proxy's HTTP API against a scripted generator; and the event
log itself (pipeline/proxy/responses_replay.py)."""

from __future__ import annotations

import asyncio
import json

import pytest

from pipeline.proxy.responses_output import ResponseEvents
from pipeline.proxy.responses_replay import KEPT_ENDED, EventLog, EventLogs
from scripted_generator import FAILURE, serve_scripted
from test_responses_background import OUTPUTS, URL, create, model, read, until_requests, until_status  # noqa: F401

HELD_TEXT = OUTPUTS["wait"][0]


async def sse_events(response, count: int | None = None) -> list[dict]:
    """The server-sent events of `response`, `count` of them or to its end;
    each event's name must be its type."""
    out: list[dict] = []
    name = None
    while count is None or len(out) < count:
        line = await response.content.readline()
        if not line:
            break
        line = line.decode().rstrip("\n")
        if line.startswith("event: "):
            name = line[len("event: "):]
        elif line.startswith("data: "):
            event = json.loads(line[len("data: "):])
            assert event["type"] == name
            out.append(event)
    return out


def text_of(events: list[dict]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


def test_a_streamed_background_response_sends_its_events_as_made_and_stores_the_answer(model):
    async def scenario(client, generator):
        posted = await client.post(URL, json={"model": "tiny", "input": "[wait]", "background": True, "stream": True})
        assert posted.status == 200 and posted.headers["Content-Type"].startswith("text/event-stream")
        first = await sse_events(posted, 2)
        assert [e["type"] for e in first] == ["response.created", "response.queued"]
        assert [e["response"]["status"] for e in first] == ["queued", "queued"] and first[0]["response"]["background"]
        await until_requests(generator, 1)
        generator.release.set()
        rest = await sse_events(posted)
        events = first + rest
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert rest[0]["type"] == "response.in_progress" and rest[-1]["type"] == "response.completed"
        assert text_of(events) == HELD_TEXT
        stored = await until_status(client, first[0]["response"]["id"], "completed")
        assert stored == rest[-1]["response"] and stored["background"] is True and stored["store"] is True
    serve_scripted(model, scenario, OUTPUTS)


def test_a_dropped_stream_is_resumed_after_its_last_event_and_followed_live(model):
    async def scenario(client, generator):
        posted = await client.post(URL, json={"model": "tiny", "input": "[wait]", "background": True, "stream": True})
        seen = await sse_events(posted, 1)
        posted.close()   # the connection drops; the run goes on
        rid = seen[0]["response"]["id"]
        await until_requests(generator, 1)
        resumed = await client.get(f"{URL}/{rid}", params={"stream": "true", "starting_after": "0"})
        assert resumed.status == 200
        assert [e["type"] for e in await sse_events(resumed, 1)] == ["response.queued"]   # from the log
        generator.release.set()   # then live
        tail = await sse_events(resumed)
        assert tail[-1]["type"] == "response.completed" and text_of(tail) == HELD_TEXT
        whole = await sse_events(await client.get(f"{URL}/{rid}", params={"stream": "true"}))
        assert whole[0] == seen[0] and whole[2:] == tail   # the ended run's log, replayed whole
        late = await client.get(f"{URL}/{rid}", params={"stream": "true", "starting_after": str(len(whole) - 2)})
        assert await sse_events(late) == whole[-1:]
        past = await client.get(f"{URL}/{rid}", params={"stream": "true", "starting_after": "100000"})
        assert past.status == 200 and await sse_events(past) == []
    serve_scripted(model, scenario, OUTPUTS)


def test_a_cancelled_or_failed_stream_ends_and_the_response_reads_as_such(model):
    async def scenario(client, generator):
        posted = await client.post(URL, json={"model": "tiny", "input": "[wait]", "background": True, "stream": True})
        rid = (await sse_events(posted, 1))[0]["response"]["id"]
        await until_requests(generator, 1)
        assert (await (await client.post(f"{URL}/{rid}/cancel")).json())["status"] == "cancelled"
        assert [e["type"] for e in await sse_events(posted)] == ["response.queued"]   # then the end
        assert (await read(client, rid))["status"] == "cancelled"

        failing = await client.post(URL, json={"model": "tiny", "input": "[fails]", "background": True,
                                               "stream": True})
        events = await sse_events(failing)
        assert events[-1]["type"] == "response.failed"
        assert events[-1]["response"]["error"] == {"code": "server_error", "message": FAILURE}
        assert [e["item"]["status"] for e in events if e["type"] == "response.output_item.done"] == ["incomplete"]
        failed = await until_status(client, events[0]["response"]["id"], "failed")
        assert failed["error"]["message"] == FAILURE
        generator.release.set()
    serve_scripted(model, scenario, OUTPUTS)


def test_streams_that_cannot_be_resumed_are_a_400_naming_why(model):
    async def scenario(client, generator):
        whole = await create(client, input="[hello]")
        quiet = await create(client, input="[hello]", background=True)
        await until_status(client, quiet["id"], "completed")
        streamed = await client.post(URL, json={"model": "tiny", "input": "[hello]", "background": True,
                                                "stream": True})
        rid = (await sse_events(streamed))[0]["response"]["id"]
        for response_id, query, param, words in [
            (whole["id"], {"stream": "true"}, "stream", "was not made in the background"),
            (quiet["id"], {"stream": "true"}, "stream", "made without stream"),
            (rid, {"stream": "true", "starting_after": "-1"}, "starting_after", "non-negative integer"),
            (rid, {"stream": "true", "starting_after": "two"}, "starting_after", "non-negative integer"),
            (rid, {"starting_after": "2"}, "starting_after", "needs stream=true"),
            (rid, {"stream": "maybe"}, "stream", "true or false"),
            (rid, {"include[]": "message.output_text.logprobs"}, "include", "as it was made"),
            (rid, {"include": "message.output_text.logprobs", "stream": "true"}, "include", "as it was made"),
        ]:
            got = await client.get(f"{URL}/{response_id}", params=query)
            body = await got.json()
            assert got.status == 400 and body["error"]["param"] == param and words in body["error"]["message"], body
        obfuscated = await client.get(f"{URL}/{rid}", params={"stream": "true", "include_obfuscation": "true"})
        assert obfuscated.status == 200 and (await sse_events(obfuscated))[-1]["type"] == "response.completed"
        assert (await client.delete(f"{URL}/{rid}")).status == 200
        assert (await client.get(f"{URL}/{rid}", params={"stream": "true"})).status == 404
    serve_scripted(model, scenario, OUTPUTS)


def test_an_event_log_is_read_from_any_point_and_followed_until_it_ends():
    async def scenario():
        log = EventLog()
        log.add([{"type": "a", "sequence_number": 0}, {"type": "b", "sequence_number": 1}])
        with pytest.raises(ValueError, match="event 3 out of order"):
            log.add([{"type": "c", "sequence_number": 3}])

        async def read_all(after):
            return [e["sequence_number"] async for e in log.after(after)]
        readers = [asyncio.create_task(read_all(after)) for after in (-1, 0, 1, 5)]
        await asyncio.sleep(0)
        log.add([{"type": "c", "sequence_number": 2}])
        await asyncio.sleep(0)
        log.end()
        assert await asyncio.gather(*readers) == [[0, 1, 2], [1, 2], [2], []]
    asyncio.run(scenario())


def test_ended_logs_are_kept_for_the_last_few_and_running_ones_always():
    async def scenario():
        logs = EventLogs()
        running = logs.new("running")
        for i in range(KEPT_ENDED + 3):
            logs.new(f"r{i}")
            logs.ended(f"r{i}")
        kept = {"id": "r3", "background": True}
        assert logs.get(kept).ended and logs.get({"id": "running"}) is running
        for gone in ("r0", "r1", "r2"):
            with pytest.raises(Exception, match="no events to stream"):
                logs.get({"id": gone, "background": True})
        logs.drop("running")
        assert running.ended   # a reader following it stops
    asyncio.run(scenario())


def test_a_cut_closes_the_item_being_written_as_incomplete():
    events = ResponseEvents({"id": "resp_1", "status": "in_progress", "output": []}, logprobs=False)
    events.opening()
    events.piece({"content": "Half"})
    cut = events.cut()
    assert [e["type"] for e in cut] == ["response.output_text.done", "response.content_part.done",
                                        "response.output_item.done"]
    assert cut[-1]["item"]["status"] == "incomplete" and cut[0]["text"] == "Half"
    assert events.cut() == []
