"""/tokenize on chats with images and videos: the tokens are the prompt the
model sees, each placeholder expanded to its media's tokens, as the
reference processor expands it and as a chat completion sends it to a
generator; bad media are 400s that name them."""

from __future__ import annotations

import asyncio

import pytest

from conftest import image_bytes, random_image
from e2e_helpers import data_url
from test_proxy_http import serve
from video_clips import write_clip

pytest.importorskip("transformers")
from reference_oracle import Reference  # noqa: E402


def image_part(data: bytes) -> dict:
    return {"type": "image_url", "image_url": {"url": data_url(data)}}


def test_a_chats_images_expand_as_the_reference_processor_expands_them(tiny_dir, tmp_path):
    reference = Reference(tiny_dir)
    images = [random_image(60, 90, seed=1), random_image(120, 40, seed=2)]
    text = "Which is larger?"
    expected = reference.inputs(text, images).input_ids[0].tolist()
    messages = [{"role": "user", "content": [*(image_part(image_bytes(i)) for i in images),
                                             {"type": "text", "text": text}]}]

    async def scenario(client, app):
        r = await client.post("/tokenize", json={"model": "tiny", "messages": messages, "return_token_strs": True})
        body = await r.json()
        assert r.status == 200, body
        assert body["tokens"] == expected and body["count"] == len(expected)
        image_tokens = expected.count(reference.image_token_id)
        assert image_tokens > 2 and body["token_strs"].count("<|image_pad|>") == image_tokens

    serve(tiny_dir, tmp_path, scenario=scenario)


def test_the_tokens_are_those_a_chat_completion_sends_a_generator_videos_included(tiny_dir, tmp_path):
    import msgspec

    from pipeline.proxy.api_types import ChatCompletionRequest, decode_json
    from pipeline.proxy.media_fetch import FetchPolicy
    from pipeline.proxy.requests import chat_work
    from stages.proxy import model_info, parse_args

    clip = write_clip(12, 4, 64, 48, seed=3).data
    content = [{"type": "video_url", "video_url": {"url": data_url(clip, "video/mp4")}},
               image_part(image_bytes(random_image(56, 84, seed=4))), {"type": "text", "text": "Describe both."}]
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}],
            "mm_processor_kwargs": {"num_frames": 4}}
    model = model_info(parse_args(["--model", str(tiny_dir), "--model-id", "tiny", "--mode", "aggregated",
                                   "--generators", "ipc://nobody"]))
    req = decode_json(msgspec.json.encode({**body, "max_tokens": 4}), ChatCompletionRequest)
    sent = asyncio.run(chat_work(req, model, FetchPolicy(), "r", "inproc://proxy")).request

    async def scenario(client, app):
        r = await client.post("/tokenize", json=body)
        shown = await r.json()
        assert r.status == 200, shown
        assert shown["tokens"] == list(sent.prompt_token_ids)
        assert len(sent.grids) == 2 and shown["count"] > len(content) + 20
        fewer = await (await client.post("/tokenize", json={**body, "mm_processor_kwargs": {"num_frames": 2}})).json()
        assert fewer["count"] < shown["count"]   # the request's sampling sets the video's tokens

    serve(tiny_dir, tmp_path, scenario=scenario)


def test_bad_or_too_many_media_are_400s_naming_them(tiny_dir, tmp_path):
    good = image_part(image_bytes(random_image(32, 32)))

    async def tokenize(client, content) -> tuple[int, dict]:
        r = await client.post("/tokenize", json={"messages": [{"role": "user", "content": content}]})
        return r.status, await r.json()

    async def scenario(client, app):
        status, body = await tokenize(client, [good, {"type": "image_url",
                                                      "image_url": {"url": "data:image/png;base64,AAAA"}}])
        assert status == 400 and body["error"]["message"].startswith("image 2:"), body
        status, body = await tokenize(client, [good] * 3)
        assert status == 400 and "too many images" in body["error"]["message"], body
        status, body = await tokenize(client, [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}])
        assert status == 400, body
        status, body = await tokenize(client, [good, {"type": "text", "text": "and text"}])
        assert status == 200 and body["count"] > 4   # the proxy still answers

    serve(tiny_dir, tmp_path, "--max-images=2", scenario=scenario)
