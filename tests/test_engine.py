"""The engine on the tiny checkpoint: batched continuous generation equals
each request run alone, in disaggregated and aggregated mode."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import random_image
from pipeline.engine.engine import Engine, EngineConfig
from pipeline.sampling_params import SamplingParams
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
        # Embeddings the engine evicted while still needed: the generator asks
        # the encoders again; here they simply arrive once more.
        for key in engine.refetch:
            due.setdefault(step + 1, []).append(key)
        engine.refetch.clear()
        step += 1
        if not engine.has_work() and step > max(arrivals) and not due:
            break
    return outputs, finished


def test_an_embedding_that_beats_its_request_waits_for_it(tiny):
    """The same image for a second request arrives (a dedup hit at the
    encoder) before that request, while other work keeps the engine
    stepping: it must still be there when the request comes."""
    model, processor = tiny
    engine = Engine(model, processor.tokenizer, EngineConfig(max_num_batched_tokens=64, kv_cache_bytes=8 << 20),
                    torch.device("cpu"))
    prompt, (key,), ((pixels, grid),) = make_request(processor, 7, 1)
    embedding = model.encode_images(pixels, [grid])[0]
    busy, _, _ = make_request(processor, 8, 0)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request("first", prompt, [key], params)
    engine.add_embedding(key, embedding)
    engine.add_request("busy", busy, [], SamplingParams(max_tokens=40, ignore_eos=True))
    done = set()
    for _ in range(100):
        done |= {o.request_id for o in engine.step() if o.finished}
        if "first" in done:
            break
    engine.add_embedding(key, embedding)          # before the second request
    for _ in range(3):
        done |= {o.request_id for o in engine.step() if o.finished}
    engine.add_request("second", prompt, [key], params)
    for _ in range(100):
        done |= {o.request_id for o in engine.step() if o.finished}
        if not engine.has_work():
            break
    assert {"first", "busy", "second"} <= done
    assert not engine.pending_embeddings and engine.scheduler.encoder_cache.used_tokens == 0


@pytest.mark.parametrize("aggregated,fast_decode", [(False, False), (True, False), (False, True)])
def test_batched_requests_equal_each_run_alone(tiny, aggregated, fast_decode):
    model, processor = tiny
    requests = {f"r{i}": make_request(processor, i, i % 4) for i in range(8)}
    expected = {rid: offline(model, p, inp, 12) for rid, (p, _, inp) in requests.items()}
    arrivals = {0: ["r0", "r1", "r2"], 2: ["r3"], 3: ["r4", "r5"], 7: ["r6", "r7"]}
    # Embeddings arrive late and out of order.
    delay = {key: (7 * hash(key)) % 9 for _, keys, _ in requests.values() for key in keys}
    config = EngineConfig(max_num_batched_tokens=96, max_num_seqs=8, block_size=8, kv_cache_bytes=4 << 20,
                          aggregated=aggregated, local_encode_tokens=512, fast_decode=fast_decode)
    engine = Engine(model, processor.tokenizer, config, torch.device("cpu"))
    outputs, finished = run_engine(engine, model, requests, arrivals, delay)
    assert outputs == expected
    assert set(finished.values()) == {"length"}
    assert engine.scheduler.block_pool.num_used == 0
    assert len(engine.scheduler.encoder_cache) == 0
    if not aggregated:
        assert engine.scheduler.stats["yields_total"] > 0  # images really were late
    # The step profile saw the prefills and the decodes, every token of them.
    profile = engine.profile.window()
    prompt_tokens = sum(len(p.token_ids) for p, _, _ in requests.values())
    decoded, mixed = profile["decode"]["tokens"], profile["mixed"]["tokens"]
    # The chat template's start is one prompt's cached prefix for the others;
    # the last sampled token is never fed back.
    hits = engine.scheduler.prefix.hits
    assert hits > 0 and hits % 8 == 0
    fed = prompt_tokens - hits + 11 * len(requests)
    if engine.scheduler.stats["preemptions_total"]:
        assert decoded + mixed > fed    # a preempted request's tokens run again
    else:
        assert decoded + mixed == fed
    kinds = [v for v in profile.values() if isinstance(v, dict)]
    assert any("encode_ms" in kind for kind in kinds) == aggregated   # local vision forwards timed
    assert engine.profile.window().keys() == {"seconds", "outside_share"}   # a new, empty window


@pytest.mark.parametrize("fast_decode,ahead", [(False, False), (True, False), (True, True)])
def test_stress_random_requests_delays_and_aborts(tiny, fast_decode, ahead):
    """200 random requests, random embedding delays, random aborts: each one
    completes or aborts cleanly and nothing is left allocated."""
    model, processor = tiny
    rng = random.Random(1234)
    requests, arrivals, delay, aborts = {}, {}, {}, {}
    for i in range(200):
        rid = f"s{i}"
        requests[rid] = make_request(processor, 1000 + i, rng.choice([0, 0, 1, 1, 2, 3]))
        arrival = rng.randrange(120)
        arrivals.setdefault(arrival, []).append(rid)
        for key in requests[rid][1]:
            delay[key] = rng.randrange(15)
        if rng.random() < 0.2:
            aborts.setdefault(arrival + rng.randrange(20), []).append(rid)
    # Tight KV and encoder-cache budgets force preemption and pending embeddings.
    config = EngineConfig(max_num_batched_tokens=128, max_num_seqs=16, block_size=8, kv_cache_bytes=256 << 10,
                          encoder_cache_tokens=400, orphan_embedding_ttl=0.0, fast_decode=fast_decode,
                          decode_ahead=ahead)
    engine = Engine(model, processor.tokenizer, config, torch.device("cpu"))
    max_tokens = 6
    outputs, finished = run_engine(engine, model, requests, arrivals, delay, max_tokens, aborts)
    aborted = {rid for ids in aborts.values() for rid in ids}
    assert set(finished) == set(requests)
    for rid in requests:
        if finished[rid] == "length":
            assert len(outputs[rid]) == max_tokens
        else:
            assert finished[rid] == "abort" and rid in aborted
    assert engine.scheduler.stats["preemptions_total"] > 0
    engine.step()  # lets embeddings of aborted requests age out
    assert engine.scheduler.block_pool.num_used == 0
    assert len(engine.scheduler.encoder_cache) == 0
    assert engine.scheduler.encoder_cache.num_users_total() == 0
    assert not engine.pending_embeddings
    assert not engine.live and not engine.has_work()


def test_sampling_options(tiny):
    model, processor = tiny
    prompt, keys, _ = make_request(processor, 5, 0)
    engine = Engine(model, processor.tokenizer, EngineConfig(), torch.device("cpu"))

    stop_reasons = {}   # request id -> its last output's stop_reason

    def run(rid, **params):
        engine.add_request(rid, prompt, [], SamplingParams(**params))
        tokens, reason, text = [], None, ""
        while engine.has_work():
            for out in engine.step():
                tokens += out.new_token_ids
                text += out.new_text
                reason = out.finish_reason or reason
                stop_reasons[rid] = out.stop_reason
        return tokens, reason, text

    greedy, _, greedy_text = run("g", max_tokens=10, ignore_eos=True)
    seeded = [run(f"s{i}", max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)[0] for i in range(2)]
    assert seeded[0] == seeded[1]                     # per-request seed is reproducible
    other = run("s-other", max_tokens=10, temperature=1.0, seed=8, ignore_eos=True)[0]
    assert other != seeded[0]
    top1 = run("k1", max_tokens=10, temperature=2.0, top_k=1, seed=3, ignore_eos=True)[0]
    assert top1 == greedy                             # top-k 1 is greedy
    tiny_p = run("p", max_tokens=10, temperature=2.0, top_p=1e-6, seed=3, ignore_eos=True)[0]
    assert tiny_p == greedy                           # top-p keeps at least the top token
    stop_id = greedy[3]
    first = greedy.index(stop_id)
    tokens, reason, text = run("stopid", max_tokens=10, stop_token_ids=[stop_id], ignore_eos=True)
    assert tokens == greedy[:first + 1] and reason == "stop"
    # As vLLM: the stop token ends the token ids, and its text is left out;
    # stop_reason names it (None where a length limit ended the request).
    assert text == processor.tokenizer.decode(greedy[:first])
    assert stop_reasons["stopid"] == stop_id and stop_reasons["g"] is None
    # EOS is checked first (as vLLM): asked for as a stop token too, it names no stop_reason, unless ignored.
    eos = processor.tokenizer.eos_token_ids[0]
    for rid, ignore_eos, expected in (("eos", False, None), ("eos-ignored", True, eos)):
        tokens, reason, _ = run(rid, max_tokens=4, logit_bias=((eos, 100.0),), stop_token_ids=[eos],
                                ignore_eos=ignore_eos)
        assert (tokens, reason, stop_reasons[rid]) == ([eos], "stop", expected)
    tokens, reason, _ = run("min", max_tokens=10, min_tokens=6, stop_token_ids=[stop_id], ignore_eos=True)
    assert stop_id not in tokens[:6]
    # A stop string cuts the text before it and is never sent in part.
    target = greedy_text[5:8]
    assert target.strip(), "the tiny model's greedy text has no stop string to test with"
    _, reason, text = run("stopstr", max_tokens=10, stop=["never there", target], ignore_eos=True)
    assert reason == "stop" and target not in text and greedy_text.startswith(text)
    assert stop_reasons["stopstr"] == target
    # Not before min_tokens (as vLLM): the stop string found first is passed.
    tokens, reason, text = run("minstr", max_tokens=10, min_tokens=10, stop=[target], ignore_eos=True)
    assert tokens == greedy and reason == "length" and text == greedy_text
    # Completed by the last token allowed, it still ends the request as "stop".
    ends_at = next(n for n in range(1, 11) if target in processor.tokenizer.decode(greedy[:n]))
    _, reason, text = run("laststr", max_tokens=ends_at, stop=[target], ignore_eos=True)
    assert reason == "stop" and target not in text
