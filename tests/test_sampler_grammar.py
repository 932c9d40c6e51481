"""Grammar masks filled ahead of sampling (engine/grammar.py): Grammars.fill
into its reused buffer writes whole rows (equal to llguidance's fill into a
fresh all-ones and a fresh all-zeros buffer), GrammarMasks.apply masks the
constrained rows only, and the engine on the tiny model, a constrained
request batched beside free ones (greedy and sampled), writes JSON that
follows the schema."""

from __future__ import annotations

import json

import jsonschema
import llguidance
import pytest
import torch

from pipeline.engine.engine import Engine, EngineConfig
from pipeline.engine.grammar import Grammars, unpack_bitmask
from pipeline.engine.request import SamplingParams
from pipeline.models.loader import load_model
from pipeline.processing.processor import Processor

SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]},
                                          "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["colour", "n"], "additionalProperties": False}


def grammar() -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, overrides={"whitespace_flexible": False})


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    loaded = load_model(tiny_dir)
    return loaded.model, Processor.from_checkpoint(tiny_dir, loaded.config.image_token_id)


@pytest.fixture(scope="module")
def grammars(tiny):
    model, processor = tiny
    return Grammars(processor.tokenizer.to_json(), model.spec.language.vocab_size,
                    tuple(processor.tokenizer.eos_token_ids))


def fresh_fill(grammars, matchers, value: int) -> torch.Tensor:
    import llguidance.torch as llt   # not at collection: it loads triton, which the kernel tests set up first

    bitmask = torch.full((len(matchers), (grammars.vocab_size + 31) // 32), value, dtype=torch.int32)
    llt.fill_next_token_bitmask_par(grammars.executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
    return bitmask


def test_fill_reuses_its_buffer_and_writes_whole_rows(grammars):
    first, second = grammars.matcher(grammar()), grammars.matcher(grammar())
    masks = grammars.fill([first, None, second])
    assert masks.rows == [0, 2] and torch.equal(masks.bitmask, fresh_fill(grammars, [first, second], -1))
    opening = unpack_bitmask(masks.bitmask, grammars.vocab_size)[0].nonzero().flatten().tolist()
    assert 0 < len(opening) < grammars.vocab_size   # the grammar constrains the first token
    first.consume_token(opening[0])
    again = grammars.fill([None, first])   # the buffer's first row still holds the old mask
    assert again.rows == [1] and again.bitmask.data_ptr() == masks.bitmask.data_ptr()
    assert torch.equal(again.bitmask, fresh_fill(grammars, [first], -1))
    assert torch.equal(again.bitmask, fresh_fill(grammars, [first], 0))
    assert not torch.equal(again.bitmask[0], masks.bitmask[1])   # the state moved on
    assert grammars.fill([None, None]) is None


def test_apply_masks_only_the_constrained_rows(grammars):
    matcher = grammars.matcher(grammar())
    logits = torch.randn(3, grammars.vocab_size)
    masked = logits.clone()
    grammars.fill([None, matcher, None]).apply(masked)
    allowed = unpack_bitmask(fresh_fill(grammars, [matcher], -1), grammars.vocab_size)[0]
    assert torch.equal(masked[[0, 2]], logits[[0, 2]])
    assert torch.equal(masked[1, allowed], logits[1, allowed]) and torch.isinf(masked[1, ~allowed]).all()
    whole = logits[1:2].clone()
    grammars.fill([matcher]).apply(whole)   # every row constrained: masked in place
    assert torch.equal(whole, masked[1:2])


def test_engine_follows_the_schema_beside_free_requests(tiny):
    model, processor = tiny
    engine = Engine(model, processor.tokenizer, EngineConfig(), torch.device("cpu"))
    messages = [{"role": "user", "content": [{"type": "text", "text": "Answer in JSON."}]}]
    prompt = processor.chat_prompt(messages, [])
    settings = {"json": SamplingParams(max_tokens=40, grammar=grammar(), logprobs=2, repetition_penalty=1.2),
                "json-sampled": SamplingParams(max_tokens=40, grammar=grammar(), temperature=1.0, top_p=0.9, seed=5),
                "free": SamplingParams(max_tokens=10, ignore_eos=True, logprobs=1),
                "sampled": SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.8, seed=3)}
    for rid, params in settings.items():
        engine.add_request(rid, prompt, [], params)
    tokens = {rid: [] for rid in settings}
    reasons = {}
    while engine.has_work():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            reasons[out.request_id] = out.finish_reason or reasons.get(out.request_id)
    for rid in ("json", "json-sampled"):
        assert reasons[rid] == "stop", (rid, processor.tokenizer.decode(tokens[rid]))
        jsonschema.validate(json.loads(processor.tokenizer.decode(tokens[rid], skip_special_tokens=True)), SCHEMA)
    assert len(tokens["free"]) == len(tokens["sampled"]) == 10
