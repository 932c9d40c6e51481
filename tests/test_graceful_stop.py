"""Stopping the whole box (`systemctl stop` or `restart`, Ctrl-C) loses no
request in flight: epd-launch stops the proxy first, which refuses new
connections and lets its requests finish (--drain-timeout) while the
encoders and generators still serve them; they stop after it. A request
still running when the drain ends gets an error it can read."""

from __future__ import annotations

import base64
import signal
import time

import httpx
import openai
import pytest

from conftest import image_bytes, random_image
from pipeline.bench.launched import LaunchedStack

STOP_AFTER = 20   # streamed chunks before the launcher gets SIGTERM


@pytest.fixture
def box(tmp_path, request):
    """`epd-launch --encoders 1 --generators 1` on the CPU, with the drain
    timeout the test asks for (`request.param`)."""
    stack = LaunchedStack(["--encoders", "1", "--generators", "1", "--device", "cpu",
                           "--drain-timeout", str(request.param)], tmp_path / "logs")
    try:
        stack.start(ready_timeout=120)
        yield stack
    finally:
        stack.stop()


def stream_then_stop(stack: LaunchedStack, max_tokens: int) -> tuple[int, str | None, object, bool]:
    """A streamed image chat of `max_tokens`; SIGTERM to the launcher
    mid-stream, as systemd sends it. Returns (chunks, finish reason, usage,
    whether new connections were refused meanwhile)."""
    client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    image = "data:image/png;base64," + base64.b64encode(image_bytes(random_image(64, 64))).decode()
    chunks = client.chat.completions.create(
        model=model, max_tokens=max_tokens, temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                               {"type": "text", "text": "a long story"}]}])
    seen, reason, usage, refused = 0, None, None, False
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].delta.content:
            seen += 1
            if seen == STOP_AFTER:
                stack.proc.send_signal(signal.SIGTERM)
                refused = new_connections_refused(stack.base_url)
        if chunk.choices:
            reason = chunk.choices[0].finish_reason or reason
        if chunk.usage:
            usage = chunk.usage
    return seen, reason, usage, refused


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


@pytest.mark.parametrize("box", [30.0], indirect=True)
def test_stopping_the_box_lets_a_stream_in_flight_finish(box, tmp_path):
    _, reason, usage, refused = stream_then_stop(box, max_tokens=2000)
    assert refused, "the proxy kept taking new connections while draining"
    assert reason == "length" and usage.completion_tokens == 2000
    assert box.proc.wait(timeout=60) == 0
    assert "stopping: 1 request(s) in flight may finish" in (tmp_path / "logs" / "proxy.log").read_text()


@pytest.mark.parametrize("box", [0.5], indirect=True)
def test_a_stream_that_outlasts_the_drain_ends_with_an_error_it_can_read(box, tmp_path):
    """Not a cut connection: an error event the SDK raises, then [DONE]."""
    with pytest.raises(openai.APIError, match="the server stopped before this request finished"):
        stream_then_stop(box, max_tokens=6000)
    assert box.proc.wait(timeout=60) == 0
    assert "did not finish within 0.5 s; they end with an error" in (tmp_path / "logs" / "proxy.log").read_text()
