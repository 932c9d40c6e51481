"""vLLM's --mm-processor-kwargs end to end on the tiny model: with the
same image bounds at every stage, an image costs the tokens the bounds
give it (fewer than the checkpoint's own), in EPD and aggregated mode, and
the answer is the offline generation's under those bounds; an encoder given
other bounds than the proxy's fails the request with an error naming the
flag rather than filling the prompt wrongly (the bounds salt the images'
content hashes, which the encoder checks)."""

from __future__ import annotations

import json

import httpx
import pytest

from conftest import image_bytes, random_image
from e2e_helpers import chat_messages, serving
from pipeline.processing.image_config import ImageProcessorConfig
from stack import Stack

BOUNDS = {"max_pixels": 112 * 112}
FLAG = ("--mm-processor-kwargs", json.dumps(BOUNDS))
IMAGE = image_bytes(random_image(224, 224, seed=7))


def stack_with(tmp_path_factory, tiny_dir, name, encoder_args=FLAG, **layout):
    return Stack(tmp_path_factory.mktemp(name), tiny_dir, generator_args=FLAG, proxy_args=FLAG,
                 encoder_args=encoder_args, **layout)


@pytest.fixture(scope="module")
def epd(tiny_dir, tmp_path_factory):
    yield from serving(stack_with(tmp_path_factory, tiny_dir, "bounds-epd", encoders=1, generators=1))


@pytest.fixture(scope="module")
def aggregated(tiny_dir, tmp_path_factory):
    yield from serving(stack_with(tmp_path_factory, tiny_dir, "bounds-agg", encoders=0, generators=1,
                                  aggregated=True))


def ask(stack) -> dict:
    return httpx.post(stack.base_url + "/v1/chat/completions", timeout=120, json={
        "model": "tiny", "messages": chat_messages([IMAGE], "What is it?"), "max_tokens": 6, "temperature": 0,
        "ignore_eos": True}).json()


def test_an_image_costs_what_the_bounds_give_in_both_layouts(epd, aggregated, tiny_dir):
    from pipeline.models.loader import load_model
    from pipeline.offline import GenerateRequest, OfflineModel
    from pipeline.processing.media_prompt import video_tokens_of
    from pipeline.processing.processor import Processor

    loaded = load_model(tiny_dir)
    spec = loaded.model.spec
    own = OfflineModel(loaded, Processor.from_checkpoint(tiny_dir, spec.image_token_id, video_tokens_of(spec)))
    bounded = OfflineModel(loaded, Processor.from_checkpoint(tiny_dir, spec.image_token_id, video_tokens_of(spec),
                                                             image_overrides=BOUNDS))
    assert bounded.processor.image_config == ImageProcessorConfig.from_checkpoint(tiny_dir, BOUNDS)
    request = GenerateRequest("What is it?", [IMAGE], 6, ignore_eos=True)
    expected = bounded.generate(request)   # offline, under the same bounds: the reference
    assert len(expected.prompt_token_ids) < len(own.generate(request).prompt_token_ids)
    for stack in (epd, aggregated):
        reply = ask(stack)
        assert reply["usage"]["prompt_tokens"] == len(expected.prompt_token_ids), reply
        assert reply["choices"][0]["message"]["content"] == expected.text


def test_an_encoder_with_other_bounds_fails_the_request_clearly(tiny_dir, tmp_path_factory):
    for stack in serving(stack_with(tmp_path_factory, tiny_dir, "bounds-mismatch", encoder_args=(), encoders=1,
                                    generators=1)):
        reply = httpx.post(stack.base_url + "/v1/chat/completions", timeout=120, json={
            "model": "tiny", "messages": chat_messages([IMAGE], "x"), "max_tokens": 2})
        assert reply.status_code >= 400 and "--mm-processor-kwargs" in reply.json()["error"]["message"]
