"""Issue 19's encoder failover with real processes on the tiny model
(tests/stack.py): an embedding lost with its dead encoder is encoded again
from the bytes the proxy keeps, and with every encoder dead and
`--encode-fallback local` the generators encode the images themselves. No
request fails in either; the encoders killed here are never restarted
(the Stack restarts nothing by itself)."""

from __future__ import annotations

import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from itertools import count

import pytest

from conftest import image_bytes, random_image
from e2e_helpers import chat, serving
from pipeline.hashing import content_hash, media_salt
from pipeline.processing.image import ImageProcessorConfig
from pipeline.proxy.routing import encoder_order
from stack import Stack
from waiting import until

FALLBACK_ON = "no encoder is up: generators encode the images themselves"
FALLBACK_OFF = "an encoder is up: encode jobs go to the encoders again"


def nothing_held(stack: Stack, dead: tuple[str, ...] = ()) -> None:
    """Every request over, and nothing it took is still held by a live stage
    (stats are polled: waited for). The proxy keeps a dead stage's last stats,
    taken while it worked: its `dead` names are left out."""
    names = ("epd_running_requests", "epd_waiting_requests", "epd_kv_blocks_used", "epd_encoder_cache_tokens",
             "epd_arena_leases")
    instances = [stack.encoder_instances[int(name.removeprefix("enc"))] for name in dead]

    def held() -> dict[str, float]:
        return {key: value for key, value in stack.metrics().items() if value and key.split("{")[0] in names
                and not any(f'instance="{i}"' in key for i in instances)}

    deadline = time.monotonic() + 30
    while left := held():
        assert time.monotonic() < deadline, f"left over: {left}"
        time.sleep(0.1)


@pytest.fixture
def small_cache(tmp_path_factory, tiny_dir):
    """Three encoders, and a generator whose encoder cache holds one image of
    16 tokens. The proxy's down timeout (60 s) outlasts the test: it never
    sends a dead encoder's jobs on by itself, so only the generator's asking
    again can bring the lost embedding back. No prefix caching: the tests
    send a prompt again, and its images must be read again."""
    yield from serving(Stack(tmp_path_factory.mktemp("refetch"), tiny_dir, encoders=3, generators=1,
                             generator_args=("--encoder-cache-tokens", "24", "--no-enable-prefix-caching"),
                             proxy_args=("--stage-timeout", "60")))


def placed_images(stack: Stack, tiny_dir) -> tuple[bytes, bytes]:
    """Two 16-token images P and Q: P's encoders in hash order begin enc0, enc2;
    Q's begins enc1 (the search over seeds is deterministic)."""
    salt = media_salt("tiny", ImageProcessorConfig.from_checkpoint(tiny_dir).settings_key())
    enc0, enc1, enc2 = stack.encoder_addresses

    def first_with(prefix: list[str], seeds) -> bytes:
        for seed in seeds:
            data = image_bytes(random_image(112, 112, seed=seed))
            if encoder_order(content_hash(data, salt), stack.encoder_addresses)[:len(prefix)] == prefix:
                return data
        raise AssertionError("unreachable: the seeds are endless")

    return first_with([enc0, enc2], count(7000)), first_with([enc1], count(8000))


def test_an_embedding_lost_with_its_dead_encoder_is_encoded_again(small_cache, tiny_dir):
    """Q's embedding reaches the generator's cache (it holds one image) while
    P's encoder is stopped; Q's encoder is then SIGKILLed and kept down. When
    P comes, Q is evicted to make room for it (P is read first), and the
    refetch from Q's dead encoder goes unanswered: the generator asks the
    proxy, which sends Q's job again from the bytes it kept, to another
    encoder than the silent one. The request ends with the tokens it has with every encoder up."""
    stack = small_cache
    p, q = placed_images(stack, tiny_dir)
    expected = chat(stack, [p, q], "Compare them.", max_tokens=8, ignore_eos=True)
    asked_before = stack.total("epd_embedding_refetches_total", how="proxy")
    until(lambda: stack.total("epd_encoder_cache_tokens") == 0, "the first request's images still cached")
    stack.procs["enc0"].send_signal(signal.SIGSTOP)     # P's job waits there, unread
    try:
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(chat, stack, [p, q], "Compare them.", max_tokens=8, ignore_eos=True)
            until(lambda: stack.total("epd_encoder_cache_tokens") >= 16, "Q's embedding never reached the cache")
            stack.stop_stage("enc1", signal.SIGKILL)
            stack.procs["enc0"].send_signal(signal.SIGCONT)
            got = future.result(timeout=120)
    finally:
        stack.procs["enc0"].send_signal(signal.SIGCONT)
    assert got == expected and got[2].completion_tokens == 8
    until(lambda: stack.total("epd_embedding_refetches_total", how="proxy") > asked_before,
          "the generator never asked the proxy for Q again")
    assert stack.total("epd_embedding_refetches_total", how="failed") == 0
    assert stack.total("epd_requests_total", status="error") == 0
    assert "lost 1 image embedding(s)" in stack.whole_log()   # the proxy's line: it sent the job again
    nothing_held(stack, dead=("enc1",))


@pytest.fixture
def fallback(tmp_path_factory, tiny_dir):
    flag = ("--encode-fallback", "local")
    # No prefix caching: the same prompts are sent again, and their images must be encoded again.
    yield from serving(Stack(tmp_path_factory.mktemp("fallback"), tiny_dir, encoders=3, generators=1,
                             generator_args=(*flag, "--no-enable-prefix-caching"), proxy_args=flag))


def test_with_every_encoder_dead_the_generator_encodes_and_no_request_fails(fallback):
    """60 requests with distinct images, encoders up; then all three are
    SIGKILLed and kept down, and the same 60 again: the generator encodes
    every image itself, each request gets the tokens it got before, and the
    metric counts 60. One log line says so; an encoder back takes new jobs."""
    stack = fallback
    images = [image_bytes(random_image(64, 64 + i, seed=5000 + i)) for i in range(60)]

    def all_60():
        with ThreadPoolExecutor(20) as pool:
            return list(pool.map(lambda i: chat(stack, [images[i]], f"image {i}", max_tokens=4, ignore_eos=True),
                                 range(60)))

    # With the fallback on, /health does not wait for the encoders: a box
    # slower to load them would encode the first requests locally.
    until(lambda: stack.total("epd_stage_up", stage="encoder") == 3, "the encoders did not come up", 120)
    expected = all_60()
    assert stack.total("epd_encode_fallback_local_total") == 0
    for name in ("enc0", "enc1", "enc2"):
        stack.stop_stage(name, signal.SIGKILL)
    until(lambda: stack.total("epd_stage_up", stage="encoder") == 0, "the proxy still sees an encoder up")
    with urllib.request.urlopen(stack.base_url + "/health", timeout=5) as r:
        assert r.status == 200      # generators that encode serve without encoders
    assert stack.total("epd_encode_fallback_local_total") == 0

    got = all_60()
    assert [usage.completion_tokens for _, _, usage in got] == [4] * 60
    assert [text for text, _, _ in got] == [text for text, _, _ in expected]
    until(lambda: stack.total("epd_encode_fallback_local_total") == 60, "the fallback encodes were not counted")
    assert stack.total("epd_requests_total", status="error") == 0
    assert stack.whole_log().count(FALLBACK_ON) == 1 and FALLBACK_OFF not in stack.whole_log()

    stack.restart_stage("enc0")
    instance = stack.encoder_instances[0]
    until(lambda: stack.total("epd_stage_up", stage="encoder", instance=instance) == 1, "enc0 did not come back",
          120)
    until(lambda: stack.total("epd_encoder_jobs_total", instance=instance, outcome="encoded") == 0,
          "the new enc0's stats did not replace the old one's")
    text, _, usage = chat(stack, [image_bytes(random_image(70, 90, seed=6000))], "after", max_tokens=4,
                          ignore_eos=True)
    assert usage.completion_tokens == 4
    until(lambda: stack.total("epd_encoder_jobs_total", instance=instance, outcome="encoded") == 1,
          "the job after the encoder came back did not go to it")
    assert stack.total("epd_encode_fallback_local_total") == 60
    assert stack.whole_log().count(FALLBACK_OFF) == 1
    nothing_held(stack, dead=("enc1", "enc2"))
