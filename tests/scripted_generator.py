"""A scripted generator for the proxy's HTTP tests, in-process: real
sockets and the generator's side of the protocol, answering each generate
request with a crafted model output cut into deltas, and a proxy app in
front of it."""

from __future__ import annotations

import asyncio
import json

import zmq.asyncio
from aiohttp.test_utils import TestClient, TestServer

from pipeline import protocol, transport
from pipeline.proxy.dispatcher import Dispatcher
from pipeline.proxy.media_fetch import FetchPolicy
from pipeline.proxy.server import ProxyApp

FAILURE = "the scripted generator failed"


class ScriptedGenerator:
    """Answers stats requests, and each generate request with the output
    that its prompt names (`outputs[key]` for a prompt holding "[key]"),
    one delta per `piece` characters. An output is its text, or (its text,
    the finish reason) where it ends otherwise than "stop"; finish reason
    "error" sends the text, then a failure (as a generator whose request
    failed partway: a 500 with FAILURE as its message); "held" waits for
    `release` to be set, then answers as "stop" does."""

    def __init__(self, ctx, address: str, tokenizer, piece: int, outputs: dict[str, str]) -> None:
        self.address, self.tokenizer, self.piece, self.outputs = address, tokenizer, piece, outputs
        self.inbox, self.outbox = transport.Inbox(ctx, address), transport.Outbox(ctx)
        self.requests: list[protocol.GenerateRequest] = []
        self.release = asyncio.Event()

    def start(self) -> None:
        self.inbox.listen(self.on_message)

    def on_message(self, message) -> None:
        if isinstance(message, protocol.StatsRequest):
            self.outbox.try_send(message.reply_to, protocol.StageStats("generator", "g", {}, {}, self.address, "one"))
        elif isinstance(message, protocol.GenerateRequest):
            self.requests.append(message)
            asyncio.get_running_loop().create_task(self.answer(message))

    async def answer(self, request: protocol.GenerateRequest) -> None:
        prompt = self.tokenizer.decode(request.prompt_token_ids)
        text = next(out for key, out in self.outputs.items() if f"[{key}]" in prompt)
        text, finish = text if isinstance(text, tuple) else (text, "stop")
        if finish == "held":
            await self.release.wait()
            finish = "stop"
        pieces = [text[i:i + self.piece] for i in range(0, len(text), self.piece)]
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1 and finish != "error"
            logprobs = ((-0.5, (7,), (-0.5,)),) if request.sampling.logprobs is not None else ()
            self.outbox.try_send(request.reply_to, protocol.TokenDelta(
                request.request_id, (7,), piece, last, finish if last else "", len(request.prompt_token_ids),
                i + 1, logprobs=logprobs))
            await asyncio.sleep(0)   # a yield: the deltas go out one by one
        if finish == "error":
            self.outbox.try_send(request.reply_to, protocol.TokenDelta(
                request.request_id, (), "", True, "error", len(request.prompt_token_ids), len(pieces),
                error=FAILURE, status=500))

    def close(self) -> None:
        self.inbox.close()
        self.outbox.close()


def serve_scripted(model, scenario, outputs: dict[str, str], piece: int = 1, **app_options) -> None:
    """Run `await scenario(client, generator)` against a proxy for `model`
    whose one generator is scripted with `outputs`; app_options: ProxyApp's."""
    async def run():
        ctx = zmq.asyncio.Context()
        generator = ScriptedGenerator(ctx, "inproc://scripted-gen", model.processor.tokenizer, piece, outputs)
        generator.start()
        dispatcher = Dispatcher(ctx, "inproc://scripted-proxy", [], [generator.address], aggregated=True,
                                ping_interval=0.05)
        try:
            async with TestClient(TestServer(ProxyApp(dispatcher, model, FetchPolicy(), **app_options).build())) as client:
                while (await client.get("/health")).status != 200:
                    await asyncio.sleep(0.02)
                await scenario(client, generator)
        finally:
            generator.close()
            ctx.term()

    asyncio.run(run())


async def events(response) -> list[dict]:
    """A server-sent-events answer's chunks, after checking that it ended with [DONE]."""
    text = await response.text()
    assert text.endswith("data: [DONE]\n\n")
    return [json.loads(line[6:]) for line in text.split("\n\n") if line.startswith("data: {")]
