"""Proxy pieces alone: routing, image URL policy, request bodies."""

from __future__ import annotations

import asyncio
import base64

import pytest

from pipeline.proxy.api_types import ApiError, parse_body
from pipeline.proxy.sampling_fields import stop_strings
from pipeline import protocol
from pipeline.proxy.media_fetch import FetchPolicy, fetch_image
from pipeline.proxy.responses import Usage, usage_of
from pipeline.proxy.routing import encoder_order, least_loaded


def test_rendezvous_order_is_stable_and_moves_only_the_lost_encoders_hashes():
    encoders = [f"ipc:///run/enc{i}" for i in range(4)]
    hashes = [f"{i:032x}" for i in range(400)]
    first = {h: encoder_order(h, encoders)[0] for h in hashes}
    assert first == {h: encoder_order(h, list(reversed(encoders)))[0] for h in hashes}   # order-free
    assert len(set(first.values())) == 4                                               # spread
    survivors = encoders[1:]
    for h in hashes:
        new = encoder_order(h, survivors)[0]
        if first[h] != encoders[0]:
            assert new == first[h]                    # untouched by the loss
        else:
            assert new == encoder_order(h, encoders)[1]   # goes to its next choice


def test_least_loaded_generator():
    assert least_loaded(["a", "b", "c"], {"a": 5, "b": 2, "c": 2}) == "b"


def run(coro):
    return asyncio.run(coro)


def test_image_url_policy(tmp_path):
    data = b"\x89PNG fake"
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    assert run(fetch_image(url, FetchPolicy())) == data
    with pytest.raises(ApiError, match="base64"):
        run(fetch_image("data:image/png,rawtext", FetchPolicy()))
    with pytest.raises(ApiError, match="larger than"):
        run(fetch_image(url, FetchPolicy(max_bytes=4)))
    with pytest.raises(ApiError, match="^video larger than 4 bytes"):   # the error names the kind
        run(fetch_image(url, FetchPolicy(max_bytes=4), kind="video"))
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "a.png").write_bytes(data)
    (tmp_path / "secret.png").write_bytes(b"secret")
    policy = FetchPolicy(allowed_dirs=(allowed,))
    assert run(fetch_image(f"file://{allowed}/a.png", policy)) == data
    with pytest.raises(ApiError, match="allowed folders"):
        run(fetch_image(f"file://{allowed}/../secret.png", policy))     # no escape by ..
    with pytest.raises(ApiError, match="allowed folders"):
        run(fetch_image(f"file://{tmp_path}/secret.png", FetchPolicy()))
    with pytest.raises(ApiError, match="disabled"):
        run(fetch_image("http://example.invalid/a.png", FetchPolicy(allow_http=False)))
    with pytest.raises(ApiError, match="unsupported image URL scheme"):
        run(fetch_image("gopher://x", FetchPolicy()))


@pytest.mark.parametrize("body,fragment", [
    (b"{\"messages\": [", "malformed JSON"),
    (b"[1, 2]", "invalid request"),
    (b'{"messages": "hi"}', "invalid request"),
    (b'{"messages": [{"role": "user", "content": "x"}], "n": 17}', "n must be in"),
    (b'{"messages": [{"role": "user", "content": "x"}], "n": 0}', "n must be in"),
    (b'{"messages": []}', "non-empty"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": "many"}', "max_tokens"),
])
def test_bad_bodies(body, fragment):
    with pytest.raises(ApiError, match=fragment) as info:
        parse_body(body, "chat")
    assert info.value.status == 400


def test_stop_strings():
    assert stop_strings("x") == ("x",) and stop_strings(["a", "b"]) == ("a", "b") and stop_strings(None) == ()
    with pytest.raises(ApiError):
        stop_strings([""])


def test_one_failed_fetch_cancels_its_siblings(monkeypatch):
    import pipeline.proxy.requests as requests_module

    started, cancelled = asyncio.Event(), []

    async def fetch(url, policy, session=None, kind="image"):
        if url == "bad":
            await started.wait()
            raise ApiError("cannot fetch bad")
        started.set()
        try:
            await asyncio.sleep(3600)   # a slow download
        except asyncio.CancelledError:
            cancelled.append(url)
            raise

    monkeypatch.setattr(requests_module, "fetch_image", fetch)

    async def scenario():
        with pytest.raises(ApiError, match="cannot fetch bad"):
            await requests_module.fetch_all([("image", "bad"), ("image", "slow")], FetchPolicy())
        await asyncio.sleep(0)   # the cancellation is delivered on the next turn
        return list(cancelled)   # before asyncio.run cancels what is left

    assert run(scenario()) == ["slow"]


def _last(prompt: int, completion: int, cached: int) -> protocol.TokenDelta:
    return protocol.TokenDelta("r", (), "", True, "length", prompt, completion, cached_tokens=cached)


def test_usage_names_cached_tokens_only_when_asked_and_counts_each_prompt_once():
    assert usage_of(_last(10, 3, 8)) == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}
    assert usage_of(_last(10, 3, 8), details=True)["prompt_tokens_details"] == {"cached_tokens": 8}
    # Two prompts with two choices each (choice k * n + i): each prompt's first counts its prompt.
    usage = Usage(details=True)
    for index, last in enumerate([_last(10, 3, 8), _last(10, 4, 10), _last(6, 5, 0), _last(6, 1, 6)]):
        usage.add(last, counts_prompt=index % 2 == 0)
    assert usage.body() == {"prompt_tokens": 16, "completion_tokens": 13, "total_tokens": 29,
                            "prompt_tokens_details": {"cached_tokens": 8}}
