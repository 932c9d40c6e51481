"""Helpers for the end-to-end tests: starting a stack as a fixture, and
requests through the official openai SDK."""

from __future__ import annotations

import base64
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai

from conftest import image_bytes, random_image


def serving(stack):
    """A module fixture's body: the stack, healthy, closed afterwards."""
    try:
        stack.wait_healthy()
        yield stack
    finally:
        stack.close()


def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def data_url(data: bytes, mime="image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def chat_messages(images: list[bytes], text: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": data_url(b)}} for b in images]
    return [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]


def chat(stack, images, text, stream=False, max_tokens=16, **extra):
    c = client(stack)
    kwargs = dict(model="tiny", messages=chat_messages(images, text), max_tokens=max_tokens, temperature=0,
                  extra_body=extra or None)
    if not stream:
        r = c.chat.completions.create(**kwargs)
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage
    chunks = c.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    text_out, reason, usage = "", None, None
    for chunk in chunks:
        if chunk.choices:
            text_out += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
        if chunk.usage:
            usage = chunk.usage
    return text_out, reason, usage


IMAGES = {n: [image_bytes(random_image(80 + 40 * i, 120 - 10 * i, seed=50 + i)) for i in range(n)] for n in (0, 1, 2)}


def long_requests(stack, n: int, max_tokens: int, disturb, texts: list[str] | None = None,
                  **sampling) -> list[tuple[str | None, object]]:
    """n streamed image chats (greedy unless `sampling` says otherwise);
    once every one is generating, `disturb()`. Asserts that each was still
    running then (it ended after the disturbance began), so the disturbance
    hit it in flight however fast the machine decodes. Returns (finish
    reason, usage) per request; `texts`, if given, gets each one's text."""
    generating = [threading.Event() for _ in range(n)]
    streamed = [""] * n

    def one(i: int):
        chunks = client(stack).chat.completions.create(
            model="tiny", messages=chat_messages(IMAGES[1], f"long {i}"), max_tokens=max_tokens,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            **{"temperature": 0, **sampling})
        reason, usage = None, None
        for chunk in chunks:
            if chunk.choices:
                if chunk.choices[0].delta.content:
                    generating[i].set()
                    streamed[i] += chunk.choices[0].delta.content
                reason = chunk.choices[0].finish_reason or reason
            if chunk.usage:
                usage = chunk.usage
        return reason, usage, time.monotonic()

    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(one, i) for i in range(n)]
        assert all(event.wait(60) for event in generating), "not every request started generating"
        disturbed_at = time.monotonic()
        disturb()
        results = [f.result(timeout=90) for f in futures]
    assert all(ended > disturbed_at for _, _, ended in results), "a request ended before the disturbance"
    if texts is not None:
        texts[:] = streamed
    return [(reason, usage) for reason, usage, _ in results]
