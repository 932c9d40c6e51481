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
from pipeline.sampling_params import SamplingParams
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


def test_choose_is_sample_then_logprobs_in_one_copy(grammars):
    """choose() (engine/choose.py) against its pieces one at a time: the same
    tokens (greedy, penalised, constrained, seeded sampling in one batch),
    the logprobs of the rows that asked, each matcher one token further and
    the penalised rows' counts recorded."""
    from pipeline.engine.choose import choose
    from pipeline.engine.logprobs import batch_logprobs
    from pipeline.engine.penalties import PenaltyPool
    from pipeline.engine.sampler import SamplingRow, make_generator, sample

    vocab = grammars.vocab_size
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(5)) * 3
    settings = [SamplingParams(8, logprobs=3), SamplingParams(8, repetition_penalty=1.3, logprobs=1),
                SamplingParams(8), SamplingParams(8, temperature=0.7, seed=11, logprobs=0)]

    def batch(pool):
        matcher = grammars.matcher(grammar())
        rows = [SamplingRow(p, make_generator(p)) for p in settings]
        rows[1].pool_row = pool.take([4, 5])
        rows[2].matcher = matcher
        return rows, grammars.fill([row.matcher for row in rows])

    pool_a, pool_b = PenaltyPool(vocab, 2, torch.device("cpu")), PenaltyPool(vocab, 2, torch.device("cpu"))
    rows, masks = batch(pool_a)
    chosen = choose(logits, rows, pool_a, masks, grammars)
    again, again_masks = batch(pool_b)
    tokens = sample(logits, again, pool_b, again_masks)
    assert chosen.tokens == tokens
    asking = [0, 1, 3]
    want = batch_logprobs(logits, asking, [tokens[i] for i in asking], [3, 1, 0])
    assert chosen.logprobs == dict(zip(asking, want))
    # The constrained row's matcher took its token (sample() leaves matchers alone): its next mask differs.
    consumed = grammars.fill([rows[2].matcher]).bitmask.clone()
    assert not torch.equal(consumed, grammars.fill([again[2].matcher]).bitmask)
    assert pool_a.counts[rows[1].pool_row, tokens[1]].item() == 1.0 and pool_a.counts.sum().item() == 1.0
