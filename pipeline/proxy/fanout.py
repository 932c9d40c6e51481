"""n > 1, or a batch of completion prompts: one request, many choices.

The proxy sends n copies of the generate request: ids `rid.0` ... `rid.n-1`,
seeds `seed`, `seed + 1`, ... when the request is seeded (so its n answers
are the same on every run, wherever each copy runs), and each copy its own
encode jobs (the encoders' single flight encodes a shared image once). The
copies' deltas are merged into one answer whose choices carry their index;
usage counts the prompt once and every choice's tokens. A batch of
completion prompts (ids `rid.pK`) is n copies of each, in prompt order:
choice k * n + i is prompt k's i-th, and usage counts each prompt once.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import msgspec
from aiohttp import web

from pipeline.proxy import token_ids
from pipeline.proxy.access import MODEL_NAME_KEY, response_id
from pipeline.proxy.api_types import ApiError
from pipeline.proxy.flights import Choices, Flight, Work
from pipeline.proxy.request_log import log_aborted
from pipeline.proxy.responses import (ChatDeltas, Usage, continuous_usage, error_response, final_usage,
                                     prompt_logprobs_at_top, response_body, usage_of)


def copies(work: Work, n: int) -> list[Work]:
    """The n requests one API request with `n` stands for."""
    if n == 1:
        return [work]
    out, choices = [], Choices(n)
    for i in range(n):
        request, sampling = work.request, work.request.sampling
        rid = f"{request.request_id}.{i}"
        seeded = msgspec.structs.replace(sampling, seed=None if sampling.seed is None else sampling.seed + i)
        jobs = [msgspec.structs.replace(job, job_id=f"{job.job_id}.{i}", request_id=rid) for job in work.jobs]
        out.append(replace(work, request=msgspec.structs.replace(request, request_id=rid, sampling=seeded),
                           jobs=jobs, choices=choices))
    return out


class ManyChoices:
    """ProxyApp's serving of n copies (a mixin: it uses the app's dispatcher,
    client registry, delta reader, stream opener and metrics)."""

    async def _serve_many(self, request: web.Request, req, works: list[Work], chat: bool) -> web.StreamResponse:
        if self.stopping:    # as in _serve: the drain ended while it read its images
            raise ApiError("the server stopped before this request was sent on", status=503)
        flights: list[Flight] = []
        try:
            for work in works:
                flights.append(self.dispatcher.submit(work))
                self._clients[work.request.request_id] = (request, flights[-1])
            firsts = [await self._next(flight) for flight in flights]
            if failed := next((d for d in firsts if d.finished and d.error), None):
                self._abort_all(flights)
                return error_response(failed)
            if req.stream:
                return await self._stream_many(request, req, flights, firsts, chat)
            return await self._whole_many(request, req.n, flights, firsts, chat)
        except (asyncio.CancelledError, ConnectionResetError):
            self._abort_all(flights, client_gone=True)
            self.metrics.requests.labels("aborted").inc()
            raise
        except BaseException:
            self._abort_all(flights)   # e.g. the dispatcher refused a later copy (503)
            raise
        finally:
            for work in works:
                self._clients.pop(work.request.request_id, None)

    def _abort_all(self, flights: list[Flight], client_gone: bool = False) -> None:
        for flight in flights:
            if self.dispatcher.abort(flight.work.request.request_id):
                self.metrics.generated(flight.tokens)
                if client_gone:
                    log_aborted(flight, time.monotonic())

    async def _whole_many(self, request, n: int, flights: list[Flight], firsts, chat: bool) -> web.Response:
        choices, usage = [], Usage(self.prompt_tokens_details)
        for index, (flight, delta) in enumerate(zip(flights, firsts)):
            last, choice = await self._choice(request, flight, delta, chat)
            if last.error:
                self._abort_all(flights)
                return error_response(last)
            choice["index"] = index
            choices.append(choice)
            usage.add(last, counts_prompt=index % n == 0)   # a batch's prompts count once each
        body = response_body(response_id(request, chat), request[MODEL_NAME_KEY], "", firsts[0], chat)
        body["choices"] = choices
        body["usage"] = usage.body()
        token_ids.add_to_whole(body, flights, chat)
        return web.json_response(prompt_logprobs_at_top(body) if chat else body)

    async def _stream_many(self, request, req, flights: list[Flight], firsts, chat: bool):
        stream = await self._open_stream(request, chat, flights[0].work)
        if chat:
            for index in range(1, len(flights)):
                role = stream.chunk({"role": "assistant", "content": ""}, None)
                role["choices"][0]["index"] = index
                await stream.send(token_ids.add_to_role_chunk(role, flights[index].work))
        merged: asyncio.Queue = asyncio.Queue()
        pumps = [asyncio.create_task(self._pump(i, f, d, merged)) for i, (f, d) in enumerate(zip(flights, firsts))]
        try:
            await self._send_merged(stream, req, flights, merged, chat)
        finally:
            for pump in pumps:
                pump.cancel()
        await stream.response.write(b"data: [DONE]\n\n")
        await stream.response.write_eof()
        return stream.response

    async def _pump(self, index: int, flight: Flight, delta, merged: asyncio.Queue) -> None:
        try:
            merged.put_nowait((index, delta))
            while not delta.finished:
                delta = await self._next(flight)
                merged.put_nowait((index, delta))
        except ConnectionResetError as exc:
            merged.put_nowait((index, exc))

    async def _send_merged(self, stream, req, flights: list[Flight], merged: asyncio.Queue, chat: bool) -> None:
        offsets, ids = [0] * len(flights), [token_ids.StreamedIds(f, chat) for f in flights]
        deltas = [ChatDeltas(stream.tools, flight.work.reasoning) for flight in flights]
        echoes = [await self._open_echo(stream, f, i) for i, f in enumerate(flights)]   # sent with the first pieces
        done, usage = 0, Usage(self.prompt_tokens_details)
        while done < len(flights):
            index, delta = await merged.get()
            if isinstance(delta, Exception):
                raise delta
            if delta.error:
                self._abort_all(flights)
                await stream.send(ApiError(delta.error, delta.status or 500).body())
                return
            text = (echoes[index].text if echoes[index] else "") + delta.text
            payload = deltas[index].delta(delta.text, delta.finished) if chat else text
            chunk = stream.chunk(payload, deltas[index].finish_reason(delta.finish_reason) or None, delta.stop_reason)
            chunk["choices"][0]["index"] = index
            if flights[index].work.request.sampling.logprobs is not None:
                chunk["choices"][0]["logprobs"], offsets[index] = self.piece_logprobs(
                    chat, flights[index], delta, offsets[index], echoes[index])
            if continuous_usage(req):
                chunk["usage"] = usage_of(delta)
            ids[index].hold(delta.token_ids)
            if (payload if deltas[index].parses else text) or delta.finished or delta.logprobs:
                await stream.send(ids[index].attach(chunk))
                echoes[index] = None
            if delta.finished:
                done += 1
                usage.add(delta, counts_prompt=index % req.n == 0)
        if final_usage(req, self.force_usage):
            chunk = stream.chunk(None, None)
            chunk["choices"], chunk["usage"] = [], usage.body()
            await stream.send(chunk)
