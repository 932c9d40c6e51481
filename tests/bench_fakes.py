"""The synthetic OpenAI-style SSE server and workload the epd-bench tests
share: known sleeps per chunk, optional failures, one request at a time,
or requests that hang until the client cancels them."""

from __future__ import annotations

import asyncio
import json
import threading
from contextlib import contextmanager

from aiohttp import web

from pipeline.bench.client import run_sweep
from pipeline.bench.dataset import RandomMMConfig


def small_dataset(num_prompts: int = 8, output_len: int = 6, **overrides) -> RandomMMConfig:
    fields = dict(num_prompts=num_prompts, input_len=20, output_len=output_len, range_ratio=0.0,
                  base_items=1, items_range_ratio=0.0, buckets={(32, 48, 1): 1.0}, image_reuse=0.0)
    fields.update(overrides)
    return RandomMMConfig(**fields)


FIRST_DELAY, GAP, NUM_CHUNKS = 0.05, 0.01, 6


class Hang:
    """Which requests the synthetic server leaves hanging after their first
    chunk (by arrival index), and the ones it saw the client abort."""

    def __init__(self, first: int, count: int):
        self.first, self.count = first, count
        self.aborted: list[int] = []
        self.all_aborted = asyncio.Event()

    def hangs(self, index: int) -> bool:
        return self.first <= index < self.first + self.count

    async def forever(self, index: int) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:  # the client closed the stream
            self.aborted.append(index)
            if len(self.aborted) == self.count:
                self.all_aborted.set()
            raise


def fake_server(seen: list[dict], fail_every: int = 0, serial: bool = False, hang: Hang | None = None):
    """`serial`: one request at a time (a capacity of ~10 req/s), so a faster
    rate falls behind; `hang`: some requests never end unless cancelled."""
    one_at_a_time = asyncio.Lock()

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model"}]})

    async def stream(request: web.Request, index: int) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(NUM_CHUNKS):
            await asyncio.sleep(FIRST_DELAY if i == 0 else GAP)
            chunk = {"choices": [{"index": 0, "delta": {"content": f"t{i} "}}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
            if hang is not None and hang.hangs(index):
                await hang.forever(index)
        usage = {"prompt_tokens": 7, "completion_tokens": NUM_CHUNKS, "total_tokens": 7 + NUM_CHUNKS}
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
        return resp

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append(body)
        if fail_every and len(seen) % fail_every == 0:
            return web.json_response({"error": {"message": "synthetic"}}, status=500)
        if not serial:
            return await stream(request, len(seen) - 1)
        async with one_at_a_time:
            return await stream(request, len(seen) - 1)

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    return app


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    # handler_cancellation: a client that closes its stream cancels the
    # handler, as a real server aborts the request.
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def sweep_against_fake(dataset, rates, slos, fail_every=0, max_concurrency=4, serial=False):
    seen: list[dict] = []
    runner, base_url = await serve(fake_server(seen, fail_every, serial))
    try:
        results = await run_sweep(base_url, None, dataset, rates, 1.0,
                                  max_concurrency, seed=3, slos=slos, show_progress=False)
    finally:
        await runner.cleanup()
    return results, seen


@contextmanager
def endpoint_thread(**server_options):
    """The synthetic server on a loop thread of its own, so a CLI subprocess
    can reach it; every loop operation is submitted to that thread."""
    seen: list[dict] = []
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    runner, base_url = asyncio.run_coroutine_threadsafe(serve(fake_server(seen, **server_options)), loop).result(10)
    try:
        yield base_url, seen
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
