"""The logits processors (engine/penalties.py) against transformers': the
batched operations equal the reference processors on random logits, and
the engine's greedy tokens with each setting equal transformers' generate
with the same processor, several settings batched together in one engine."""

from __future__ import annotations

import pytest
import torch

from conftest import random_image
from pipeline.engine.engine import Engine, EngineConfig
from pipeline.engine.penalties import PenaltyPool, apply_bias_and_penalties, apply_min_p
from pipeline.sampling_params import SamplingParams
from pipeline.models.loader import load_model
from pipeline.processing.image import preprocess_images
from pipeline.processing.processor import Processor

transformers = pytest.importorskip("transformers")
from reference_oracle import Reference  # noqa: E402

VOCAB = 64


class OpenAIPenalties(transformers.LogitsProcessor):
    """OpenAI's frequency and presence penalties over the generated tokens
    (transformers has none): the reference written from the definition."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids, scores):
        for b in range(scores.shape[0]):
            counts = torch.bincount(input_ids[b, self.prompt_len:], minlength=scores.shape[1]).to(scores.dtype)
            scores[b] -= self.frequency * counts + self.presence * (counts > 0).to(scores.dtype)
        return scores


def test_batched_operations_equal_the_reference_processors():
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB) * 4
    prompts = [[1, 5, 5, 9], [2, 3], [7]]
    outputs = [[5, 11, 11, 11], [], [7, 7, 20]]
    settings = [SamplingParams(max_tokens=8, repetition_penalty=1.7),
                SamplingParams(max_tokens=8, logit_bias=((3, 5.0), (60, -2.5))),
                SamplingParams(max_tokens=8, frequency_penalty=0.6, presence_penalty=-0.4)]
    pool = PenaltyPool(VOCAB, 2, torch.device("cpu"))
    rows = [pool.take(prompt) if i != 1 else None for i, prompt in enumerate(prompts)]
    for i, out in enumerate(outputs):
        for token in out:
            if rows[i] is not None:
                pool.record([rows[i]], [token])
    ours = logits.clone()
    apply_bias_and_penalties(ours, settings, rows, pool)

    ids = [torch.tensor([p + o]) for p, o in zip(prompts, outputs)]
    want = [transformers.RepetitionPenaltyLogitsProcessor(1.7)(ids[0], logits[0:1].clone()),
            transformers.SequenceBiasLogitsProcessor({(3,): 5.0, (60,): -2.5})(ids[1], logits[1:2].clone()),
            OpenAIPenalties(len(prompts[2]), 0.6, -0.4)(ids[2], logits[2:3].clone())]
    assert torch.allclose(ours, torch.cat(want), atol=1e-6)
    # min_p: the same tokens survive as under transformers' warper.
    scaled = logits / 0.7
    for min_p in (0.05, 0.3):
        ref = transformers.MinPLogitsWarper(min_p)(None, scaled.clone())
        got = apply_min_p(scaled, torch.full((3,), min_p))
        assert torch.equal(torch.isinf(got), torch.isinf(ref))


def test_the_pool_grows_and_rows_come_back():
    pool = PenaltyPool(VOCAB, 1, torch.device("cpu"))
    first, second = pool.take([1, 2]), pool.take([3])
    assert {first, second} == {0, 1} and pool.capacity == 2
    assert bool(pool.seen[first, 1]) and not bool(pool.seen[second, 1])   # the grown pool kept row 0
    pool.give_back(first)
    again = pool.take([4])
    assert again == first and not bool(pool.seen[again, 1]) and bool(pool.seen[again, 4])


SETTINGS = {
    "repetition": (dict(repetition_penalty=1.8), dict(repetition_penalty=1.8)),
    "repetition-below-1": (dict(repetition_penalty=0.7), dict(repetition_penalty=0.7)),
    "frequency-presence": (dict(frequency_penalty=1.5, presence_penalty=0.8), None),
    "logit-bias": (dict(logit_bias=((42, 8.0), (7, 6.5))), dict(sequence_bias={(42,): 8.0, (7,): 6.5})),
    "plain": ({}, {}),
}


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    loaded = load_model(tiny_dir)
    return loaded.model, Processor.from_checkpoint(tiny_dir, loaded.config.image_token_id), Reference(tiny_dir)


@pytest.mark.parametrize("num_images", [0, 1])
def test_engine_greedy_with_each_processor_equals_transformers(tiny, num_images):
    model, processor, ref = tiny
    text = "Tell me about colours and shapes, again and again."
    images = [random_image(64, 96, seed=3)][:num_images]
    messages = [{"role": "user", "content": [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]}]
    prompt = processor.chat_prompt(messages, [(im.height, im.width) for im in images])
    inputs = [(pixels, tuple(grid[0].tolist())) for pixels, grid in
              (preprocess_images([im], processor.image_config) for im in images)]
    reference_inputs = ref.inputs(text, images)
    assert prompt.token_ids == reference_inputs.input_ids[0].tolist()

    engine = Engine(model, processor.tokenizer, EngineConfig(aggregated=True, kv_cache_bytes=8 << 20),
                    torch.device("cpu"))
    for name, (ours, _) in SETTINGS.items():   # every setting at once: one batch
        engine.add_request(name, prompt, [f"{name}-img"] * num_images,
                           SamplingParams(max_tokens=16, ignore_eos=True, **ours), inputs or None)
    tokens: dict[str, list[int]] = {name: [] for name in SETTINGS}
    for _ in range(500):
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
        if not engine.has_work():
            break
    assert engine.penalties.free and len(engine.penalties.free) == engine.penalties.capacity   # all given back

    prompt_len = reference_inputs.input_ids.shape[1]
    for name, (_, theirs) in SETTINGS.items():
        extra = theirs if theirs is not None else dict(
            logits_processor=transformers.LogitsProcessorList([OpenAIPenalties(prompt_len, 1.5, 0.8)]))
        with torch.no_grad():
            out = ref.model.generate(**reference_inputs.generate_kwargs(), max_new_tokens=16, min_new_tokens=0,
                                     do_sample=False, eos_token_id=None, pad_token_id=0, **extra)
        assert tokens[name] == out[0, prompt_len:].tolist(), name
    # The settings matter: the tiny model repeats itself, so penalties change its answer.
    assert tokens["repetition"] != tokens["plain"] and tokens["frequency-presence"] != tokens["plain"]
