"""Several encoders, one of them dead for good (issue 19): its jobs go on to
the next encoder in their hash-affinity order, and no request fails. Real
processes on the tiny model (tests/stack.py)."""

from __future__ import annotations

import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from conftest import image_bytes, random_image
from e2e_helpers import chat, serving
from stack import Stack


@pytest.fixture(scope="module")
def three(tmp_path_factory, tiny_dir):
    yield from serving(Stack(tmp_path_factory.mktemp("three-enc"), tiny_dir, encoders=3, generators=1))


def test_an_encoder_killed_and_kept_down_fails_no_request(three):
    """60 requests with distinct images in flight. The encoder that about a
    third of them go to first is stopped before they are sent (its jobs sit
    unread), then SIGKILLed and never restarted: once the proxy sees it down,
    its jobs are sent to the next encoder, and all 60 get their tokens."""
    three.procs["enc1"].send_signal(signal.SIGSTOP)
    with ThreadPoolExecutor(20) as pool:
        futures = [pool.submit(chat, three, [image_bytes(random_image(64, 64 + i, seed=3000 + i))], f"image {i}",
                               max_tokens=4, ignore_eos=True) for i in range(60)]
        done_before = 0
        deadline = time.monotonic() + 60
        while done_before < 10:                       # the others' requests are being served meanwhile
            assert time.monotonic() < deadline, "no request completed while one encoder was stopped"
            done_before = sum(f.done() for f in futures)
            time.sleep(0.05)
        assert done_before < 60, "every request ended before the encoder died"
        three.stop_stage("enc1", signal.SIGKILL)
        results = [f.result(timeout=120) for f in futures]
    assert [usage.completion_tokens for _, _, usage in results] == [4] * 60
    deadline = time.monotonic() + 15                  # stats are polled: wait for the survivors' counts
    while (encoded := three.total("epd_encoder_jobs_total", outcome="encoded")) < 60:
        assert time.monotonic() < deadline, f"the live encoders encoded {encoded} of the 60 images"
        time.sleep(0.1)
    assert encoded == 60 and three.total("epd_encoder_jobs_total", outcome="failed") == 0
    while three.total("epd_running_requests") or three.total("epd_arena_leases"):
        assert time.monotonic() < deadline + 15, "requests or leases left over"
        time.sleep(0.1)
