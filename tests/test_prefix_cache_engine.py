"""Prefix caching in the engine on the tiny model: a prompt seen before, its
image included, gives the same greedy tokens as computed from scratch
without reading the image again, in both modes, and so does a chat's next
turn from its answer's blocks; off, nothing is reused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pipeline.engine.engine import Engine, EngineConfig
from pipeline.models.loader import load_model
from pipeline.processing.processor import Processor
from pipeline.sampling_params import SamplingParams
from test_engine import make_request, offline

PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    loaded = load_model(tiny_dir)
    return loaded.model, Processor.from_checkpoint(tiny_dir, loaded.config.image_token_id)


def run(engine: Engine, limit: int = 200) -> dict[str, list[int]]:
    outputs: dict[str, list[int]] = {}
    for _ in range(limit):
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        if not engine.has_work():
            return outputs
    raise AssertionError("the engine did not finish")


def image_prompt(processor):
    """A prompt of one image and enough text after it that the image lies
    inside the prompt's full blocks, whatever they are."""
    for seed in range(100):
        prompt, keys, inputs = make_request(processor, seed, 1)
        (start, length), = prompt.image_spans
        if len(prompt.token_ids) - (start + length) >= 24:
            return prompt, keys, inputs
    raise AssertionError("no seed gave a long enough text")


@pytest.mark.parametrize("aggregated", [False, True])
def test_a_prompt_seen_before_gives_the_same_tokens_without_its_image(tiny, aggregated):
    model, processor = tiny
    prompt, (key,), inputs = image_prompt(processor)
    engine = Engine(model, processor.tokenizer, EngineConfig(block_size=8, kv_cache_bytes=4 << 20,
                                                             aggregated=aggregated), torch.device("cpu"))
    forwards = []
    if aggregated:
        vision = engine.runner.vision
        engine.runner.vision = lambda pixels, grids: forwards.append(len(grids)) or vision(pixels, grids)
    embedding = model.encode_images(inputs[0][0], [inputs[0][1]])[0]
    engine.add_request("first", prompt, [key], PARAMS, inputs if aggregated else None)
    if not aggregated:
        engine.add_embedding(key, embedding)
    first = run(engine)["first"]
    assert first == offline(model, prompt, inputs, 8)
    assert engine.scheduler.encoder_cache.used_tokens == 0   # the image's embedding is gone

    engine.add_request("again", prompt, [key], PARAMS, inputs if aggregated else None)
    again = [token for out in engine.step() for token in out.new_token_ids]   # admitted: the prefix reused
    if not aggregated:   # its embedding, come now, is dropped: the request is past the image
        engine.add_embedding(key, embedding)
        assert not engine.pending_embeddings
    again += run(engine).get("again", [])   # never given the embedding: the cached prefix holds the image
    assert again == first
    prefix = engine.scheduler.prefix
    n = len(prompt.token_ids)
    assert prefix.queries == 2 * n and prefix.hits == (n - 1) // 8 * 8
    assert forwards == ([1] if aggregated else [])
    assert engine.scheduler.block_pool.num_used == 0


def test_off_nothing_is_reused(tiny):
    model, processor = tiny
    prompt, keys, inputs = make_request(processor, 3, 0)
    engine = Engine(model, processor.tokenizer, EngineConfig(block_size=8, kv_cache_bytes=4 << 20,
                                                             prefix_caching=False), torch.device("cpu"))
    for rid in ("a", "b"):
        engine.add_request(rid, prompt, keys, PARAMS)
        run(engine)
    assert engine.scheduler.prefix is None and "prefix_cache_hits" not in engine.counters()
    fed = engine.profile.window()
    assert fed["mixed"]["tokens"] + fed.get("decode", {}).get("tokens", 0) == 2 * (len(prompt.token_ids) + 7)


def test_a_chat_s_next_turn_reuses_the_answer_s_blocks_and_gives_the_tokens_computed_afresh(tiny):
    model, processor = tiny
    prompt, (key,), inputs = image_prompt(processor)
    engine = Engine(model, processor.tokenizer, EngineConfig(block_size=8, kv_cache_bytes=4 << 20),
                    torch.device("cpu"))
    engine.add_request("turn-1", prompt, [key], SamplingParams(max_tokens=16, ignore_eos=True))
    engine.add_embedding(key, model.encode_images(inputs[0][0], [inputs[0][1]])[0])
    answer = run(engine)["turn-1"]
    follow_up = processor.tokenizer.encode("and what else is in it?")
    turn = dataclasses.replace(prompt, token_ids=list(prompt.token_ids) + answer + follow_up)
    engine.add_request("turn-2", turn, [key], PARAMS)   # no embedding: the image lies in the reused blocks
    assert run(engine)["turn-2"] == offline(model, turn, inputs, 8)
    computed = len(prompt.token_ids) + len(answer) - 1   # the answer's last token was never fed
    assert engine.scheduler.prefix.hits == computed // 8 * 8 > len(prompt.token_ids)
    assert engine.scheduler.block_pool.num_used == 0
