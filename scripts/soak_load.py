"""The soak's load: a seeded open-loop mix of chat requests, and what became
of each one.

The mix: text only or 1-4 images (some of them repeating an earlier image
byte for byte), streamed or whole, and streams the client hangs up on after
a few chunks. Every request asks for `max_tokens` with `ignore_eos`, so a
success is checkable: finish reason "length" and exactly that many
completion tokens. Each request carries its own X-Request-Id (`soak-N`),
which the proxy's request log names.

One connection per request (no keep-alive): a connection refused then means
that nothing was sent (the proxy is restarting), so the request is sent
again after a short backoff and the retry counted; so is a connection cut
before the request could be written (aiohttp's "Can not write request
body": the proxy closed its listener with it still queued). Any other
error is an outcome of its own.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp
import numpy as np

from pipeline.bench.dataset import PIXEL_POOL_SIZE, NoiseImage, arrivals_within
from pipeline.prompt_words import WORDS

IMAGE_SIZES = ((56, 56), (112, 112), (112, 168), (224, 224))
RECENT_IMAGES = 16          # a repeated image is one of the last this many distinct ones
RETRY_BACKOFF_S = 0.25      # after a refused connection
RETRY_FOR_S = 60.0          # how long a request keeps knocking on a refused port

# The outcomes a request can have (`failed` has a cause besides).
SUCCEEDED, ABORTED, FAILED = "succeeded", "aborted", "failed"


@dataclass(frozen=True)
class Mix:
    """Shares of the load (each a probability)."""

    text_only: float = 0.25
    repeat_image: float = 0.3     # per image, once there are earlier ones
    stream: float = 0.5
    abort: float = 0.15           # of the streamed requests
    min_tokens: int = 4
    max_tokens: int = 160


@dataclass(frozen=True)
class Planned:
    index: int
    at_s: float                    # send time after the load's start
    prompt: str
    images: tuple[NoiseImage, ...]
    repeated: int                  # how many of the images repeat an earlier one's bytes
    stream: bool
    abort_after: int | None        # content chunks read before hanging up, at most half (None: to the end)
    max_tokens: int

    @property
    def request_id(self) -> str:
        return f"soak-{self.index}"


@dataclass
class Result:
    index: int
    images: int
    stream: bool
    sent_s: float                  # first attempt, seconds after the load's start
    ended_s: float = 0.0
    outcome: str = FAILED
    cause: str = ""                # for failures: http_503, stream_error, timeout, ...
    error: str = ""
    status: int | None = None
    retries: int = 0               # connections refused before one was accepted
    resets: int = 0                # connections cut before the request was written
    chunks: int = 0                # content chunks of a stream
    tokens: int | None = None      # completion tokens the server reported
    extra: dict = field(default_factory=dict)


def plan_load(rng: np.random.Generator, duration_s: float, rate: float, mix: Mix = Mix()) -> list[Planned]:
    """rate * duration_s requests spread over `duration_s` (Poisson gaps, their count fixed)."""
    offsets = arrivals_within(duration_s, rate, 1.0, rng, least=1)
    run_token = int(rng.integers(2 ** 62))   # another seed sends other bytes
    recent: list[NoiseImage] = []
    planned = []
    for index, at in enumerate(offsets):
        count = 0 if rng.random() < mix.text_only else int(rng.integers(1, 5))
        images, repeated = [], 0
        for item in range(count):
            if recent and rng.random() < mix.repeat_image:
                images.append(recent[int(rng.integers(len(recent)))])
                repeated += 1
                continue
            height, width = IMAGE_SIZES[int(rng.integers(len(IMAGE_SIZES)))]
            image = NoiseImage(height, width, int(rng.integers(PIXEL_POOL_SIZE)), f"soak {run_token} {index} {item}")
            images.append(image)
            recent = (recent + [image])[-RECENT_IMAGES:]
        stream = bool(rng.random() < mix.stream)
        tokens = int(rng.integers(mix.min_tokens, mix.max_tokens + 1))
        abort_after = int(rng.integers(1, tokens // 2 + 1)) if stream and rng.random() < mix.abort else None
        words = " ".join(WORDS[i] for i in rng.integers(len(WORDS), size=int(rng.integers(4, 40))))
        planned.append(Planned(index, float(at), words, tuple(images), repeated, stream, abort_after, tokens))
    return planned


def payload(model: str, p: Planned) -> dict:
    content = [image.content_part() for image in p.images] + [{"type": "text", "text": p.prompt}]
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": p.max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": p.stream}
    if p.stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def send(session: aiohttp.ClientSession, base_url: str, model: str, p: Planned, t0: float) -> Result:
    """One request to its end; never raises (bar cancellation)."""
    result = Result(p.index, len(p.images), p.stream, time.monotonic() - t0)
    give_up_at = time.monotonic() + RETRY_FOR_S
    try:
        while True:
            try:
                async with session.post(base_url + "/v1/chat/completions", json=payload(model, p),
                                        headers={"X-Request-Id": p.request_id}) as resp:
                    result.status = resp.status
                    if resp.status != 200:
                        _fail(result, f"http_{resp.status}", _error_text(await resp.text()))
                    elif p.stream:
                        await _read_stream(resp, p, result)
                    else:
                        _judge(result, p, await resp.json(content_type=None))
                break
            except aiohttp.ClientOSError as exc:
                unsent = _unsent(exc)
                if unsent is None or time.monotonic() > give_up_at:
                    raise
                setattr(result, unsent, getattr(result, unsent) + 1)
                await asyncio.sleep(RETRY_BACKOFF_S)
    except asyncio.TimeoutError:
        _fail(result, "timeout", "no answer within the client's timeout")
    except (aiohttp.ClientError, ValueError) as exc:
        _fail(result, "connection", f"{type(exc).__name__}: {exc}")
    result.ended_s = time.monotonic() - t0
    return result


def _unsent(exc: aiohttp.ClientOSError) -> str | None:
    """Which retry counter an error that proves the request unsent counts in:
    a refused connection (the port is closed), or one cut before the request
    was written (the stopping proxy closed its listener with our connection
    still in its accept queue); None for any other error."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        return "retries" if isinstance(exc.os_error, ConnectionRefusedError) else None
    return "resets" if str(exc).startswith("Can not write request body") else None


async def _read_stream(resp: aiohttp.ClientResponse, p: Planned, result: Result) -> None:
    finish, done = None, False
    async for raw in resp.content:
        line = raw.decode("utf-8").strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            done = True
            break
        chunk = json.loads(data)
        if "error" in chunk:
            _fail(result, "stream_error", str(chunk["error"].get("message", chunk["error"])))
            return
        if chunk.get("usage"):
            result.tokens = chunk["usage"].get("completion_tokens")
        for choice in chunk.get("choices") or ():
            finish = choice.get("finish_reason") or finish
            if (choice.get("delta") or {}).get("content"):
                result.chunks += 1
        if p.abort_after is not None and result.chunks >= p.abort_after and finish is None:
            resp.close()       # hang up mid-stream: the proxy aborts the request
            result.outcome = ABORTED
            return
    if not done:
        _fail(result, "stream_cut", f"the stream ended without [DONE] after {result.chunks} chunks")
        return
    _check_length(result, p, finish)


def _judge(result: Result, p: Planned, body: dict) -> None:
    choices = body.get("choices") or [{}]
    result.tokens = (body.get("usage") or {}).get("completion_tokens")
    _check_length(result, p, choices[0].get("finish_reason"))


def _check_length(result: Result, p: Planned, finish: str | None) -> None:
    if finish == "length" and result.tokens == p.max_tokens:
        result.outcome = SUCCEEDED
    else:
        _fail(result, "bad_answer", f"finish_reason {finish!r}, {result.tokens} tokens (asked for {p.max_tokens})")


def _fail(result: Result, cause: str, error: str) -> None:
    result.outcome, result.cause, result.error = FAILED, cause, error[:300]


def _error_text(body: str) -> str:
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:300]


async def run_load(base_url: str, model: str, planned: list[Planned], t0: float,
                   request_timeout_s: float) -> list[Result]:
    """Send each planned request at its time (open loop) and wait for all."""
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=request_timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        tasks = []
        for p in planned:
            delay = t0 + p.at_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(session, base_url, model, p, t0)))
        return list(await asyncio.gather(*tasks))
