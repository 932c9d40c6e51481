"""Prefix caching across real processes on the tiny model: the same image
request twice gives the same greedy answer, the second from the first's
cached blocks, counted in vLLM's prefix cache series on /metrics."""

from __future__ import annotations

import time

from conftest import image_bytes, random_image
from e2e_helpers import chat
from stack import Stack


def test_a_request_seen_before_is_answered_the_same_from_cached_blocks(tmp_path, tiny_dir):
    stack = Stack(tmp_path, tiny_dir, encoders=1, generators=1)
    try:
        stack.wait_healthy()
        image = [image_bytes(random_image(96, 80, seed=41))]
        question = "describe the picture in a few words, with colours and shapes"
        first, _, usage = chat(stack, image, question, max_tokens=8, ignore_eos=True)
        deadline = time.monotonic() + 15   # the proxy polls the stages' stats
        while stack.total("vllm:prefix_cache_queries_total") < usage.prompt_tokens:
            assert time.monotonic() < deadline, "the first request's prompt never showed as queried"
            time.sleep(0.1)
        assert stack.total("vllm:prefix_cache_hits_total") == 0
        again, _, _ = chat(stack, image, question, max_tokens=8, ignore_eos=True)
        assert again == first
        while stack.total("vllm:prefix_cache_queries_total") < 2 * usage.prompt_tokens:
            assert time.monotonic() < deadline + 15, "the second request's prompt never showed as queried"
            time.sleep(0.1)
        hits = stack.total("vllm:prefix_cache_hits_total")
        assert usage.prompt_tokens - 16 <= hits < usage.prompt_tokens   # all but the last, partial block
    finally:
        stack.close()
