"""Prefix caching across real processes on the tiny model: the same image
request twice gives the same greedy answer, the second from the first's
cached blocks, counted in vLLM's prefix cache series on /metrics and, with
--enable-prompt-tokens-details, in its usage's cached_tokens; a cache_salt
keeps the blocks to requests with the same salt."""

from __future__ import annotations

from conftest import image_bytes, random_image
from e2e_helpers import chat
from stack import Stack
from waiting import until


def test_a_request_seen_before_is_answered_the_same_from_cached_blocks(tmp_path, tiny_dir):
    stack = Stack(tmp_path, tiny_dir, encoders=1, generators=1, proxy_args=("--enable-prompt-tokens-details",))
    try:
        stack.wait_healthy()
        image = [image_bytes(random_image(96, 80, seed=41))]
        question = "describe the picture in a few words, with colours and shapes"
        first, _, usage = chat(stack, image, question, max_tokens=8, ignore_eos=True)
        assert usage.prompt_tokens_details.cached_tokens == 0

        def queried() -> float:   # the proxy polls the stages' stats
            return stack.total("vllm:prefix_cache_queries_total")

        until(lambda: queried() >= usage.prompt_tokens, "the first request's prompt to show as queried", 15)
        assert stack.total("vllm:prefix_cache_hits_total") == 0
        again, _, streamed = chat(stack, image, question, stream=True, max_tokens=8, ignore_eos=True)
        assert again == first
        until(lambda: queried() >= 2 * usage.prompt_tokens, "the second request's prompt to show as queried", 15)
        hits = stack.total("vllm:prefix_cache_hits_total")
        assert usage.prompt_tokens - 16 <= hits < usage.prompt_tokens   # all but the last, partial block
        assert streamed.prompt_tokens_details.cached_tokens == hits
        # A cache_salt (vLLM's) keeps a tenant's blocks to requests with the same salt.
        salted = [chat(stack, image, question, max_tokens=8, ignore_eos=True, cache_salt="tenant-a")
                  for _ in range(2)]
        assert [text for text, _, _ in salted] == [first, first]
        assert [u.prompt_tokens_details.cached_tokens for _, _, u in salted] == [0, hits]
    finally:
        stack.close()
