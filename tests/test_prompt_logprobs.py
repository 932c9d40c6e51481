"""vLLM's prompt_logprobs in the engine, against transformers (CPU,
float32, the tiny checkpoint, one image): each prompt token's logprob
from the second on, its rank and the top 3 equal the reference model's
log_softmax over the prompt, with the prompt computed in several chunks and
its logits in several slices, beside a request that asks for none; they
come with the first token only, cover every position even when the prefix
cache holds the prompt, and a request moved after its first token sends
none again."""

from __future__ import annotations

import pytest
import torch

import pipeline.engine.prompt_logprobs as prompt_logprobs_module
from conftest import random_image
from pipeline.engine.engine import Engine, EngineConfig
from pipeline.engine.output import Resumed
from pipeline.models.loader import load_model
from pipeline.processing.image import preprocess_images
from pipeline.processing.processor import Processor
from pipeline.sampling_params import SamplingParams

pytest.importorskip("transformers")
from reference_oracle import Reference  # noqa: E402

TEXT = "Name three colours."
TOP = 3


@pytest.fixture(scope="module")
def setup(tiny_dir):
    loaded = load_model(tiny_dir)
    processor = Processor.from_checkpoint(tiny_dir, loaded.config.image_token_id)
    images = [random_image(48, 80, seed=4)]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": TEXT}]}]
    prompt = processor.chat_prompt(messages, [(im.height, im.width) for im in images])
    inputs = [(pixels, tuple(grid[0].tolist())) for pixels, grid in
              (preprocess_images([im], processor.image_config) for im in images)]
    ref = Reference(tiny_dir)
    with torch.no_grad():
        logits = ref.model(**ref.inputs(TEXT, images).generate_kwargs()).logits[0]
    return loaded, processor, prompt, inputs, logits.log_softmax(-1)


def run(engine, rid, prompt, inputs, resumed=None, **params):
    engine.add_request(rid, prompt, ["img"], SamplingParams(max_tokens=3, ignore_eos=True, **params), inputs,
                       resumed)
    outputs = []
    while engine.has_work():
        outputs += [out for out in engine.step() if out.request_id == rid]
    return outputs


def test_prompt_logprobs_equal_the_reference(setup, monkeypatch):
    loaded, processor, prompt, inputs, expected = setup
    ids = prompt.token_ids
    assert expected.shape[0] == len(ids)
    monkeypatch.setattr(prompt_logprobs_module, "SLICE_ROWS", 7)   # several slices a chunk
    engine = Engine(loaded.model, processor.tokenizer,
                    EngineConfig(aggregated=True, kv_cache_bytes=8 << 20, max_num_batched_tokens=32),
                    torch.device("cpu"))
    engine.add_request("plain", prompt, ["img"], SamplingParams(max_tokens=3, ignore_eos=True), inputs)
    outputs = run(engine, "asks", prompt, inputs, prompt_logprobs=TOP)
    entries = outputs[0].prompt_logprobs
    assert len(ids) > 32 and len(entries) == len(ids) - 1 and all(o.prompt_logprobs == () for o in outputs[1:])
    for position, (token, logprob, rank, top_ids, top_values) in enumerate(entries, start=1):
        row = expected[position - 1]
        assert token == ids[position] and abs(logprob - row[token].item()) <= 1e-4
        assert rank == int((row >= row[token]).sum())
        values, best = row.topk(TOP)
        assert list(top_ids) == best.tolist() and max(abs(a - b) for a, b in zip(top_values, values.tolist())) <= 1e-4
    # With the prompt now in the prefix cache, a request that asks computes it all again.
    again = run(engine, "again", prompt, inputs, prompt_logprobs=0)
    assert [(e[0], e[2]) for e in again[0].prompt_logprobs] == [(e[0], e[2]) for e in entries]
    assert all(e[3] == () for e in again[0].prompt_logprobs)
    cached = run(engine, "cached", prompt, inputs)   # one that does not ask takes the cached blocks
    assert cached[-1].num_cached_tokens > 0 and again[-1].num_cached_tokens == 0
    # Moved after its first token (its prompt ends with it): nothing sent again.
    first = outputs[0].new_token_ids[0]
    moved = prompt.__class__(list(ids) + [first], prompt.image_spans, prompt.grids)
    resumed = run(engine, "moved", moved, inputs, resumed=Resumed((first,), 0), prompt_logprobs=TOP)
    assert all(o.prompt_logprobs == () for o in resumed)
