"""Background responses (`background: true`) through the proxy's HTTP API,
against a scripted generator: answered at once as queued, then read back
with GET as in_progress and completed; cancelled while they run (and a
late answer changes nothing); failed with the generator's error; refused
as a previous_response_id until done; and the drain of a stopping proxy
waits for them."""

from __future__ import annotations

import asyncio

import pytest

from pipeline.processing.processor import Processor
from pipeline.proxy.requests import ModelInfo
from scripted_generator import FAILURE, serve_scripted

URL = "/v1/responses"
OUTPUTS = {"hello": "Hello there.", "wait": ("Took a while.", "held"), "fails": ("Half an ans", "error")}


@pytest.fixture(scope="module")
def model(tiny_dir):
    return ModelInfo("tiny", Processor.from_checkpoint(tiny_dir, image_token_id=0), 4096, b"salt")


async def create(client, status: int = 200, **body) -> dict:
    response = await client.post(URL, json={"model": "tiny", **body})
    reply = await response.json()
    assert response.status == status, reply
    return reply


async def read(client, response_id: str) -> dict:
    return await (await client.get(f"{URL}/{response_id}")).json()


async def until_status(client, response_id: str, status: str) -> dict:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while (found := await read(client, response_id))["status"] != status:
        assert loop.time() < deadline, f"still {found['status']}, not {status}"
        await asyncio.sleep(0.01)
    return found


async def until_requests(generator, count: int) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while len(generator.requests) < count:
        assert loop.time() < deadline
        await asyncio.sleep(0.01)


def test_a_background_response_is_queued_then_read_back_done(model):
    async def scenario(client, generator):
        queued = await create(client, input="[wait]", background=True)
        assert (queued["status"], queued["background"], queued["output"]) == ("queued", True, [])
        await until_requests(generator, 1)
        assert (await read(client, queued["id"]))["status"] == "queued"   # no answer from its generator yet
        chained = await create(client, 400, input="[hello]", previous_response_id=queued["id"])
        assert "is queued" in chained["error"]["message"]
        generator.release.set()
        done = await until_status(client, queued["id"], "completed")
        assert done["output"][0]["content"][0]["text"] == "Took a while." and done["background"] is True
        assert done["usage"]["output_tokens"] > 0
        again = await create(client, input="[hello] go on", previous_response_id=queued["id"])
        assert again["status"] == "completed"   # a finished background response is a conversation too
        assert (await (await client.post(f"{URL}/{queued['id']}/cancel")).json())["status"] == "completed"
    serve_scripted(model, scenario, OUTPUTS)


def test_a_cancelled_one_stops_and_a_late_answer_changes_nothing(model):
    async def scenario(client, generator):
        queued = await create(client, input="[wait]", background=True)
        await until_requests(generator, 1)
        cancelled = await (await client.post(f"{URL}/{queued['id']}/cancel")).json()
        assert cancelled["status"] == "cancelled" and (await read(client, queued["id"]))["status"] == "cancelled"
        generator.release.set()   # its generator answers after all; nobody listens
        assert (await create(client, input="[hello]"))["status"] == "completed"
        assert (await read(client, queued["id"]))["status"] == "cancelled"
        other = await create(client, input="[wait]", background=True)   # released: it runs through
        await until_status(client, other["id"], "completed")
        deleted = await create(client, input="[hello]", background=True)
        assert (await client.delete(f"{URL}/{deleted['id']}")).status == 200
        assert (await client.get(f"{URL}/{deleted['id']}")).status == 404
    serve_scripted(model, scenario, OUTPUTS)


def test_a_failure_is_stored_as_failed_with_its_error(model):
    async def scenario(client, generator):
        queued = await create(client, input="[fails]", background=True)
        failed = await until_status(client, queued["id"], "failed")
        assert failed["error"] == {"code": "server_error", "message": FAILURE}
        await create(client, 400, input="[hello]", previous_response_id=queued["id"])
    serve_scripted(model, scenario, OUTPUTS)


def test_the_drain_waits_for_a_background_response(model):
    async def scenario(client, generator):
        # The ProxyApp, through its drain hook (a bound method of it).
        proxy = next(hook.__self__ for hook in client.server.app.on_shutdown if hasattr(hook, "__self__"))
        queued = await create(client, input="[wait]", background=True)
        await until_requests(generator, 1)
        assert proxy.handling == 1   # the drain counts it until it ends
        generator.release.set()
        await until_status(client, queued["id"], "completed")
        assert proxy.handling == 0
    serve_scripted(model, scenario, OUTPUTS)
