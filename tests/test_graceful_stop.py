"""Stopping the whole box (`systemctl stop` or `restart`, Ctrl-C) loses no
request in flight: epd-launch stops the proxy first, which refuses new
connections and lets its requests finish (--drain-timeout) while the
encoders and generators still serve them; they stop after it."""

from __future__ import annotations

import base64
import signal
import time

import httpx
import openai

from conftest import image_bytes, random_image
from pipeline.bench.launched import LaunchedStack

MAX_TOKENS = 2000


def test_stopping_the_box_lets_a_stream_in_flight_finish(tmp_path):
    stack = LaunchedStack(["--encoders", "1", "--generators", "1", "--device", "cpu"], tmp_path / "logs")
    try:
        stack.start(ready_timeout=120)
        client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        model = client.models.list().data[0].id
        image = "data:image/png;base64," + base64.b64encode(image_bytes(random_image(64, 64))).decode()
        chunks = client.chat.completions.create(
            model=model, max_tokens=MAX_TOKENS, temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                                   {"type": "text", "text": "a long story"}]}])
        deltas, reason, usage, refused = 0, None, None, False
        for chunk in chunks:
            if chunk.choices and chunk.choices[0].delta.content:
                deltas += 1
                if deltas == 20:
                    stack.proc.send_signal(signal.SIGTERM)   # mid-stream, as systemd would
                    refused = new_connections_refused(stack.base_url)
            if chunk.choices:
                reason = chunk.choices[0].finish_reason or reason
            if chunk.usage:
                usage = chunk.usage
        assert refused, "the proxy kept taking new connections while draining"
        assert reason == "length" and usage.completion_tokens == MAX_TOKENS
        assert stack.proc.wait(timeout=60) == 0
        assert "stopping: 1 request(s) in flight may finish" in (tmp_path / "logs" / "proxy.log").read_text()
    finally:
        stack.stop()


def new_connections_refused(base_url: str, within: float = 10.0) -> bool:
    """The launcher passes SIGTERM on to the proxy, which then stops listening."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            httpx.get(base_url + "/health", timeout=1.0)
        except httpx.ConnectError:
            return True
        time.sleep(0.05)
    return False
