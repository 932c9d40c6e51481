"""The engine on the tiny checkpoint: batched continuous generation equals
each request run alone, in disaggregated and aggregated mode."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import random_image
from pipeline.engine.engine import Engine, EngineConfig
from pipeline.engine.request import SamplingParams
from pipeline.generate import GenerationLimits, greedy_generate
from pipeline.models.loader import load_model
from pipeline.processing.image import preprocess_images
from pipeline.processing.processor import Processor

SIZES = [(60, 90), (120, 64), (200, 150), (33, 200)]


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    loaded = load_model(tiny_dir)
    return loaded.model, Processor.from_checkpoint(tiny_dir, loaded.config.image_token_id)


def make_request(processor, seed: int, num_images: int):
    rng = random.Random(seed)
    images = [random_image(*SIZES[rng.randrange(len(SIZES))], seed=seed * 10 + i) for i in range(num_images)]
    words = " ".join(rng.choice(["red", "blue", "cat", "sky", "tree", "an", "image"]) for _ in range(rng.randint(2, 30)))
    messages = [{"role": "user", "content": [{"type": "image"} for _ in images] + [{"type": "text", "text": words}]}]
    prompt = processor.chat_prompt(messages, [(im.height, im.width) for im in images])
    inputs = []
    for im in images:
        pixels, grid = preprocess_images([im], processor.image_config)
        inputs.append((pixels, tuple(grid[0].tolist())))
    keys = [f"img-{seed}-{i}" for i in range(num_images)]
    return prompt, keys, inputs


def offline(model, prompt, inputs, max_tokens):
    pixels = torch.cat([p for p, _ in inputs]) if inputs else None
    return greedy_generate(model, prompt, pixels, GenerationLimits(max_tokens, frozenset(), ignore_eos=True))


def run_engine(engine, model, requests, arrivals, embed_delay, max_tokens=12, aborts=()):
    """requests: id -> (prompt, keys, inputs); arrivals: step -> [ids];
    embed_delay: key -> steps after its request's arrival."""
    outputs: dict[str, list[int]] = {}
    finished: dict[str, str] = {}
    embeddings = {}
    due: dict[int, list[str]] = {}
    step = 0
    while step < 2000:
        for rid in arrivals.get(step, []):
            prompt, keys, inputs = requests[rid]
            engine.add_request(rid, prompt, keys, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                               inputs if engine.config.aggregated else None)
            for key, inp in zip(keys, inputs):
                embeddings[key] = model.encode_images(inp[0], [inp[1]])[0]
                due.setdefault(step + embed_delay.get(key, 0), []).append(key)
        if not engine.config.aggregated:
            for key in due.pop(step, []):
                engine.add_embedding(key, embeddings[key])
        for rid in aborts.get(step, []) if isinstance(aborts, dict) else []:
            engine.abort(rid)
            finished[rid] = "abort"
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finished[out.request_id] = out.finish_reason
        step += 1
        if not engine.has_work() and step > max(arrivals) and not due:
            break
    return outputs, finished


@pytest.mark.parametrize("aggregated", [False, True])
def test_batched_requests_equal_each_run_alone(tiny, aggregated):
    model, processor = tiny
    requests = {f"r{i}": make_request(processor, i, i % 4) for i in range(8)}
    expected = {rid: offline(model, p, inp, 12) for rid, (p, _, inp) in requests.items()}
    arrivals = {0: ["r0", "r1", "r2"], 2: ["r3"], 3: ["r4", "r5"], 7: ["r6", "r7"]}
    # Embeddings arrive late and out of order.
    delay = {key: (7 * hash(key)) % 9 for _, keys, _ in requests.values() for key in keys}
    config = EngineConfig(max_num_batched_tokens=96, max_num_seqs=8, block_size=8, kv_cache_bytes=4 << 20,
                          aggregated=aggregated, local_encode_tokens=512)
    engine = Engine(model, processor.tokenizer, config, torch.device("cpu"))
    outputs, finished = run_engine(engine, model, requests, arrivals, delay)
    assert outputs == expected
    assert set(finished.values()) == {"length"}
    assert engine.scheduler.block_pool.num_used == 0
    assert len(engine.scheduler.encoder_cache) == 0
    if not aggregated:
        assert engine.scheduler.stats["yields_total"] > 0  # images really were late
