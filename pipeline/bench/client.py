"""Send the requests on their arrival schedule and time each stream.

One aiohttp session; each request is a streaming chat completion. TTFT is the
time to the first chunk with non-empty content, ITL the gaps between content
chunks, E2EL the time to the end of the stream. Every failure becomes a
record with its error text; nothing is dropped. A search step has a stop
rule (stop.py): the requests it cancels (their HTTP streams closed, so the
server aborts them) become failed records whose error starts "cancelled:".
Fixed-rate runs have none and wait for every request.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace

import aiohttp

import numpy as np

from pipeline.bench.dataset import BenchRequest, RandomMMConfig, arrival_offsets, arrivals_within, sample_requests
from pipeline.bench.metrics import RequestRecord, by_class, detailed, summarize
from pipeline.bench.stop import CANCELLED, StopRule, next_check_at, stop_reason
from pipeline.bench.window import WindowSpec, in_window, window_summary


class BenchError(Exception):
    """A problem that stops the whole benchmark (e.g. the server is unreachable)."""


class ProtocolError(Exception):
    """The server's stream did not look like an OpenAI chat completion stream."""


def new_session() -> aiohttp.ClientSession:
    # aiohttp caps a session at 100 connections by default, which would be a
    # hidden concurrency limit; --max-concurrency is the only cap we want.
    connector = aiohttp.TCPConnector(limit=0)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=6 * 3600))


async def fetch_default_model(session: aiohttp.ClientSession, base_url: str) -> str:
    url = base_url.rstrip("/") + "/v1/models"
    try:
        async with session.get(url) as resp:
            if resp.status != 200:
                raise BenchError(f"GET {url} returned HTTP {resp.status}")
            body = await resp.json(content_type=None)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        raise BenchError(f"GET {url} failed: {exc or type(exc).__name__}") from None
    models = body.get("data") if isinstance(body, dict) else None
    if not models:
        raise BenchError(f"GET {url} listed no models; pass --model")
    return str(models[0]["id"])


def build_payload(model: str, req: BenchRequest) -> dict:
    content: list[dict] = [{"type": "text", "text": req.prompt}]
    content += req.content_parts()
    return {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": req.output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def send_request(session: aiohttp.ClientSession, base_url: str, model: str, req: BenchRequest) -> RequestRecord:
    url = base_url.rstrip("/") + "/v1/chat/completions"
    record = RequestRecord(success=False, num_images=len(req.images))
    start = time.perf_counter()
    try:
        async with session.post(url, json=build_payload(model, req)) as resp:
            try:
                if resp.status != 200:
                    text = (await resp.text())[:200].replace("\n", " ")
                    record.error = f"HTTP {resp.status}: {text}"
                    return record
                await _read_stream(resp, record, start)
            except asyncio.CancelledError:
                # Drop the connection rather than return it to the pool: the
                # server sees the client leave and aborts the request.
                resp.close()
                raise
    except (aiohttp.ClientError, asyncio.TimeoutError, ProtocolError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    return record


async def _read_stream(resp: aiohttp.ClientResponse, record: RequestRecord, start: float) -> None:
    last_token_at: float | None = None
    finished_at: float | None = None
    usage = None
    async for raw in resp.content:
        line = raw.decode("utf-8").strip()
        if not line.startswith("data:"):
            continue  # blank separators, SSE comments, event names
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            break
        now = time.perf_counter()
        chunk = json.loads(data)
        if not isinstance(chunk, dict):
            raise ProtocolError(f"chunk is not an object: {data[:100]}")
        if "error" in chunk:
            raise ProtocolError(f"server error in stream: {json.dumps(chunk['error'])[:200]}")
        if chunk.get("usage"):
            usage = chunk["usage"]
        if finished_at is None and _finish_reason(chunk):
            finished_at = now
        if _chunk_text(chunk):
            if last_token_at is None:
                record.ttft = now - start
            else:
                record.itl.append(now - last_token_at)
            last_token_at = now
    record.e2el = time.perf_counter() - start
    if last_token_at is None:
        if finished_at is None:
            raise ProtocolError("stream ended without any content")
        # Every token decoded to no text (special tokens, skipped as vLLM
        # skips them; a tiny random model does this): a whole answer that is
        # empty, which vLLM's benchmark counts as a success too. Nothing was
        # visible before the finish chunk, so that is its first token.
        record.ttft = finished_at - start
    if usage is None:
        # TPOT and throughput need real token counts; chunk counts would be a
        # silent, wrong fallback (a chunk may carry several tokens).
        raise ProtocolError("stream carried no usage (stream_options.include_usage unsupported?)")
    if not isinstance(usage.get("completion_tokens"), int):
        raise ProtocolError(f"usage has no integer completion_tokens: {json.dumps(usage)[:200]}")
    record.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    record.completion_tokens = usage["completion_tokens"]
    record.success = True


def _finish_reason(chunk: dict) -> str:
    choices = chunk.get("choices") or []
    return (choices[0].get("finish_reason") or "") if choices else ""


def _chunk_text(chunk: dict) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    delta = choices[0].get("delta") or {}
    return delta.get("content") or ""


class Progress:
    """One self-overwriting status line on stderr."""

    def __init__(self, label: str, total: int, enabled: bool = True):
        self.label, self.total, self.enabled = label, total, enabled
        self.done = self.failed = 0

    def update(self, record: RequestRecord) -> None:
        self.done += 1
        self.failed += not record.success
        if self.enabled:
            sys.stderr.write(f"\r{self.label}: {self.done}/{self.total} done, {self.failed} failed")
            if self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


async def run_load(session: aiohttp.ClientSession, base_url: str, model: str, requests: list[BenchRequest],
                   offsets: list[float], max_concurrency: int | None, progress: Progress,
                   window: WindowSpec = WindowSpec(),
                   stop: StopRule | None = None) -> tuple[list[RequestRecord], float]:
    """Open loop: each request is sent at its offset whether or not earlier ones
    finished; --max-concurrency only makes late arrivals wait for a slot.
    Without `stop` it waits for every request; with one it cancels the rest
    when the rule says so. Returns the records (in request order) and the
    run's wall duration."""
    slots = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    start = time.perf_counter()
    sent_at: list[float] = []
    finished: list[RequestRecord] = []

    async def one(req: BenchRequest, arrived: float) -> RequestRecord:
        if slots is None:
            record = await send_request(session, base_url, model, req)
        else:
            async with slots:
                record = await send_request(session, base_url, model, req)
        record.sent_at, record.done_at = arrived, time.perf_counter() - start
        finished.append(record)
        progress.update(record)
        return record

    tasks = []
    for req, offset in zip(requests, offsets):
        delay = start + offset - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        sent_at.append(time.perf_counter() - start)
        tasks.append(asyncio.create_task(one(req, sent_at[-1])))
    if stop is None:
        records = list(await asyncio.gather(*tasks))
    else:
        reason = await _wait_until_stop(tasks, sent_at, finished, start, window, stop)
        if reason is None:
            records = [task.result() for task in tasks]
        else:
            records = await _cancel_rest(tasks, requests, sent_at, start, reason, progress)
    return records, time.perf_counter() - start


async def _wait_until_stop(tasks: list[asyncio.Task], sent_at: list[float], finished: list[RequestRecord],
                           start: float, window: WindowSpec, stop: StopRule) -> str | None:
    """Wait until every task is done (None) or the stop rule gives a reason."""
    pending = set(tasks)
    while pending:
        now = time.perf_counter() - start
        reason = stop_reason(sent_at, finished, now, window, stop)
        if reason is not None:
            return reason
        wait_s = next_check_at(sent_at, finished, now, window, stop) - now
        # Until a request succeeds the shift D, and with it the verdict time,
        # is unknown: wake at the next completion. Afterwards wake only at the
        # rule's times (or once all are done), so a step of thousands of
        # requests is not re-judged per completion; a later change of D
        # moves the verdict by about that change.
        until = asyncio.ALL_COMPLETED if any(r.success for r in finished) else asyncio.FIRST_COMPLETED
        _, pending = await asyncio.wait(pending, timeout=max(wait_s, 0.0), return_when=until)
    return None


async def _cancel_rest(tasks: list[asyncio.Task], requests: list[BenchRequest], sent_at: list[float],
                       start: float, reason: str, progress: Progress) -> list[RequestRecord]:
    """Every request's record, the unfinished ones cancelled and recorded as failed with `reason`."""
    pending = [task for task in tasks if not task.done()]
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    cancelled_at = time.perf_counter() - start
    records = []
    for task, req, arrived in zip(tasks, requests, sent_at):
        if task.cancelled():
            record = RequestRecord(False, error=reason, num_images=len(req.images), sent_at=arrived,
                                   done_at=cancelled_at)
            progress.update(record)
        else:
            record = task.result()
        records.append(record)
    return records


@dataclass(frozen=True)
class ArrivalSpan:
    """A search step's arrivals: those of `seconds` at the step's rate, the
    first `warmup_s` of them warm-up, but at least `least` and at most `most`
    requests."""
    seconds: float
    least: int
    most: int | None = None
    warmup_s: float = 0.0


class BenchRunner:
    """One HTTP session and model for many runs: a sweep's rates or a search's
    steps. `window` sets how each run's sustained rates are measured; `stop`
    (a search's) lets a run cancel what a rate that fell behind left running."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, model: str, dataset: RandomMMConfig,
                 burstiness: float, max_concurrency: int | None, seed: int, slos: dict[str, float],
                 show_progress: bool = True, *, window: WindowSpec = WindowSpec(), stop: StopRule | None = None,
                 save_detailed: bool = False):
        self.session, self.base_url, self.model, self.dataset = session, base_url, model, dataset
        self.burstiness, self.max_concurrency, self.seed = burstiness, max_concurrency, seed
        self.slos, self.show_progress = slos, show_progress
        self.window, self.stop, self.save_detailed = window, stop, save_detailed

    async def measure(self, rate: float, index: int, span: ArrivalSpan | None = None) -> dict:
        """One run at `rate`: the dataset's count of requests, or as many as
        arrive within `span` (a search step). Run `index` uses seed + index, so
        later runs see different text and images and do not measure caches
        warmed earlier."""
        rng = np.random.default_rng(self.seed + index)
        if span is None:
            requests = sample_requests(self.dataset, rng)
            offsets = arrival_offsets(len(requests), rate, self.burstiness, rng).tolist()
        else:
            offsets = arrivals_within(span.seconds, rate, self.burstiness, rng, span.least, span.most,
                                      span.warmup_s).tolist()
            requests = sample_requests(replace(self.dataset, num_prompts=len(offsets)), rng)
        progress = Progress(f"rate {rate:g}", len(requests), self.show_progress)
        records, duration = await run_load(self.session, self.base_url, self.model, requests, offsets,
                                           self.max_concurrency, progress, self.window, self.stop)
        result = summarize(records, duration, self.slos)
        if self.dataset.text_only_fraction:
            result["by_class"] = by_class(records)   # not a vLLM key; every request, warm-up included
            result["window_by_class"] = by_class(in_window(records, self.window))
        # Not vLLM keys: the measurement window's rates and SLO figures (window.py).
        result.update(window_summary(records, self.window, self.slos, burst=math.isinf(rate)))
        result["cancelled"] = sum(r.error.startswith(CANCELLED) for r in records)
        # JSON has no infinity; vLLM writes the string "inf".
        result.update(model_id=self.model, num_prompts=len(requests),
                      request_rate=rate if rate != float("inf") else "inf",
                      burstiness=self.burstiness, max_concurrency=self.max_concurrency)
        if self.save_detailed:
            result["requests"] = detailed(records)
        return result


@asynccontextmanager
async def bench_runner(base_url: str, model: str | None, dataset: RandomMMConfig, burstiness: float,
                       max_concurrency: int | None, seed: int, slos: dict[str, float],
                       show_progress: bool = True, *, window: WindowSpec = WindowSpec(),
                       stop: StopRule | None = None, save_detailed: bool = False) -> AsyncIterator[BenchRunner]:
    async with new_session() as session:
        if model is None:
            model = await fetch_default_model(session, base_url)
        yield BenchRunner(session, base_url, model, dataset, burstiness, max_concurrency, seed, slos,
                          show_progress, window=window, stop=stop, save_detailed=save_detailed)


async def run_sweep(base_url: str, model: str | None, dataset: RandomMMConfig, rates: list[float],
                    burstiness: float, max_concurrency: int | None, seed: int,
                    slos: dict[str, float], show_progress: bool = True, *,
                    window: WindowSpec = WindowSpec(), save_detailed: bool = False) -> list[dict]:
    """One result dict per rate, run one after another, each waiting for all its requests."""
    async with bench_runner(base_url, model, dataset, burstiness, max_concurrency, seed, slos,
                            show_progress, window=window, save_detailed=save_detailed) as runner:
        return [await runner.measure(rate, index) for index, rate in enumerate(rates)]
