"""Log-probabilities against transformers (CPU, float32, the tiny
checkpoint): the chosen token's and the top 5 of greedy chat equal the
reference model's log_softmax within 1e-4, from the engine and through the
served stack (openai SDK, chat streamed and not, completions' shape); and
through the stack, vLLM's return_tokens_as_token_ids, prompt_logprobs and
echo."""

from __future__ import annotations

import pytest
import torch

from conftest import random_image
from pipeline.engine.engine import Engine, EngineConfig
from pipeline.sampling_params import SamplingParams
from pipeline.models.loader import load_model
from pipeline.processing.image import preprocess_images
from pipeline.processing.processor import Processor

pytest.importorskip("transformers")
from reference_oracle import Reference  # noqa: E402

TEXT = "Name three colours."
TOP = 5


@pytest.fixture(scope="module")
def reference(tiny_dir):
    return Reference(tiny_dir)


def reference_logprobs(ref, text, images, tokens):
    """The reference's log_softmax at each generated position: [len(tokens), vocab]."""
    inputs = ref.inputs(text, images)
    prompt_len = inputs.input_ids.shape[1]
    ids = torch.cat([inputs.input_ids, torch.tensor([tokens])], dim=1)
    kwargs = inputs.generate_kwargs()
    kwargs.update(input_ids=ids, attention_mask=torch.ones_like(ids),
                  mm_token_type_ids=torch.cat([inputs.mm_token_type_ids, torch.zeros(1, len(tokens), dtype=torch.int)],
                                              dim=1))
    with torch.no_grad():
        logits = ref.model(**kwargs).logits[0]
    return logits[prompt_len - 1:prompt_len - 1 + len(tokens)].log_softmax(-1)


def assert_close(ours, expected_row, token):
    """ours: (chosen logprob, top ids, top logprobs)."""
    chosen, ids, values = ours
    top_values, top_ids = expected_row.topk(len(ids))
    assert abs(chosen - expected_row[token].item()) <= 1e-4
    assert list(ids) == top_ids.tolist()
    assert max(abs(a - b) for a, b in zip(values, top_values.tolist())) <= 1e-4


@pytest.mark.parametrize("num_images", [0, 1])
def test_engine_logprobs_equal_the_reference(tiny_dir, reference, num_images):
    loaded = load_model(tiny_dir)
    processor = Processor.from_checkpoint(tiny_dir, loaded.config.image_token_id)
    images = [random_image(48, 80, seed=4)][:num_images]
    messages = [{"role": "user", "content": [{"type": "image"} for _ in images] + [{"type": "text", "text": TEXT}]}]
    prompt = processor.chat_prompt(messages, [(im.height, im.width) for im in images])
    inputs = [(pixels, tuple(grid[0].tolist())) for pixels, grid in
              (preprocess_images([im], processor.image_config) for im in images)]
    engine = Engine(loaded.model, processor.tokenizer, EngineConfig(aggregated=True, kv_cache_bytes=8 << 20),
                    torch.device("cpu"))
    engine.add_request("asks", prompt, ["img"] * num_images,
                       SamplingParams(max_tokens=10, ignore_eos=True, logprobs=TOP), inputs or None)
    engine.add_request("plain", prompt, ["img"] * num_images, SamplingParams(max_tokens=10, ignore_eos=True),
                       inputs or None)
    tokens, logprobs, plain = [], [], []
    while engine.has_work():
        for out in engine.step():
            if out.request_id == "asks":
                tokens += out.new_token_ids
                logprobs += out.logprobs
            else:
                plain += out.new_token_ids
                assert out.logprobs == ()
    assert tokens == plain and len(logprobs) == len(tokens) == 10
    expected = reference_logprobs(reference, TEXT, images, tokens)
    for i, token in enumerate(tokens):
        assert_close(logprobs[i], expected[i], token)
        assert logprobs[i][1][0] == token   # greedy: the chosen token is the likeliest


@pytest.fixture(scope="module")
def served(tiny_dir, tmp_path_factory):
    from e2e_helpers import serving
    from stack import Stack

    yield from serving(Stack(tmp_path_factory.mktemp("logprobs"), tiny_dir, encoders=1, generators=1))


def test_chat_logprobs_through_the_api(served, reference):
    from e2e_helpers import client

    kwargs = dict(model="tiny", messages=[{"role": "user", "content": [{"type": "text", "text": TEXT}]}], max_tokens=8,
                  temperature=0,
                  logprobs=True, top_logprobs=TOP, extra_body={"ignore_eos": True})
    whole = client(served).chat.completions.create(**kwargs)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == 8
    streamed = []
    for chunk in client(served).chat.completions.create(**kwargs, stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]
    # Greedy output is token-identical to the reference's: its ids are the API's tokens.
    tokens = reference.greedy(reference.inputs(TEXT, []), 8)
    assert [c.token for c in content] == [reference.tokenizer.decode([t]) for t in tokens]
    expected = reference_logprobs(reference, TEXT, [], tokens)
    assert "".join(c.token for c in content) == whole.choices[0].message.content
    for i, entry in enumerate(content):
        assert abs(entry.logprob - expected[i, tokens[i]].item()) <= 1e-4
        assert len(entry.top_logprobs) == TOP and entry.top_logprobs[0].logprob == entry.logprob
        top = expected[i].topk(TOP).values.tolist()
        assert max(abs(t.logprob - v) for t, v in zip(entry.top_logprobs, top)) <= 1e-4
        assert entry.bytes == list(entry.token.encode())
    refused = client(served).chat.completions.with_raw_response.create
    import openai

    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        refused(model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=2, top_logprobs=3)


def test_completion_logprobs_through_the_api(served):
    import httpx

    # Raw JSON: the top_logprobs dicts are keyed by token text, control characters included.
    reply = httpx.post(served.base_url + "/v1/completions", timeout=60, json={
        "model": "tiny", "prompt": "One two", "max_tokens": 6, "temperature": 0, "logprobs": 3,
        "ignore_eos": True}).json()
    lp = reply["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 6
    assert "".join(lp["tokens"]) == reply["choices"][0]["text"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(6)]
    for token, top, chosen in zip(lp["tokens"], lp["top_logprobs"], lp["token_logprobs"]):
        assert len(top) <= 3 and top[token] == pytest.approx(chosen) and max(top.values()) == pytest.approx(chosen)


def test_return_tokens_as_token_ids_names_each_token_by_its_id(served):
    """vLLM's return_tokens_as_token_ids: `token_id:<id>` wherever a token is
    named (chat's token and bytes, the completions API's tokens and
    top_logprobs keys), whole and streamed; the ids are the answer's own."""
    import json

    import httpx

    body = {"model": "tiny", "prompt": "One two", "max_tokens": 5, "temperature": 0, "logprobs": 2,
            "ignore_eos": True, "return_tokens_as_token_ids": True}
    whole = httpx.post(served.base_url + "/v1/completions", timeout=60, json=body).json()
    lp = whole["choices"][0]["logprobs"]
    ids = [int(t.removeprefix("token_id:")) for t in lp["tokens"]]
    assert len(ids) == 5 and all(t.startswith("token_id:") for t in lp["tokens"])
    text = httpx.post(served.base_url + "/detokenize", json={"model": "tiny", "tokens": ids}, timeout=10).json()
    assert text["prompt"] == whole["choices"][0]["text"]
    assert all(set(top) >= {token} and all(k.startswith("token_id:") for k in top)
               for token, top in zip(lp["tokens"], lp["top_logprobs"]))
    with httpx.stream("POST", served.base_url + "/v1/completions", timeout=60, json={**body, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    streamed = [t for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
                for t in c["choices"][0]["logprobs"]["tokens"]]
    assert streamed == lp["tokens"]
    with httpx.stream("POST", served.base_url + "/v1/completions", timeout=60,
                      json={**body, "stream": True, "n": 2}) as r:   # n copies: the fan-out keeps the option
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    named = [t for c in chunks if c["choices"] and c["choices"][0]["logprobs"]
             for t in c["choices"][0]["logprobs"]["tokens"]]
    assert len(named) == 10 and all(t.startswith("token_id:") for t in named)
    chat = httpx.post(served.base_url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 3, "temperature": 0,
        "logprobs": True, "top_logprobs": 1, "return_tokens_as_token_ids": True}).json()
    for entry in chat["choices"][0]["logprobs"]["content"]:
        assert entry["token"].startswith("token_id:") and bytes(entry["bytes"]).decode() == entry["token"]


def test_prompt_logprobs_through_the_api_equal_the_reference(served, reference):
    """vLLM's prompt_logprobs: per choice on text completions, once at the
    top of a chat response; None for the first token, then the token and
    the top k by id, with ranks; not with stream."""
    import httpx

    body = {"model": "tiny", "prompt": "One two three four", "max_tokens": 2, "temperature": 0, "n": 2,
            "prompt_logprobs": 2}
    reply = httpx.post(served.base_url + "/v1/completions", timeout=60, json=body).json()
    ids = httpx.post(served.base_url + "/tokenize", json={"model": "tiny", "prompt": body["prompt"]},
                     timeout=10).json()["tokens"]
    with torch.no_grad():
        expected = reference.model(input_ids=torch.tensor([ids])).logits[0].log_softmax(-1)
    for choice in reply["choices"]:
        found = choice["prompt_logprobs"]
        assert len(found) == len(ids) and found[0] is None
        for position, entry in enumerate(found[1:], start=1):
            token, row = ids[position], expected[position - 1]
            mine = entry[str(token)]
            assert abs(mine["logprob"] - row[token].item()) <= 1e-4 and mine["rank"] == int((row >= row[token]).sum())
            top = row.topk(2).indices.tolist()
            assert all(entry[str(t)]["rank"] == (top.index(t) + 1 if t != token else mine["rank"]) for t in top)
            assert set(entry) == {str(token), *map(str, top)}
    chat = httpx.post(served.base_url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "prompt_logprobs": 0}).json()
    assert "prompt_logprobs" not in chat["choices"][0] and chat["prompt_logprobs"][0] is None
    assert all(len(entry) == 1 for entry in chat["prompt_logprobs"][1:])
    assert "prompt_logprobs" not in httpx.post(served.base_url + "/v1/completions", timeout=60,
                                               json={**body, "prompt_logprobs": None}).json()["choices"][0]
    for extra, says in ((dict(stream=True), "stream"), (dict(prompt_logprobs=21), "[0, 20]")):
        refused = httpx.post(served.base_url + "/v1/completions", timeout=60, json={**body, **extra})
        assert refused.status_code == 400 and says in refused.json()["error"]["message"]


def test_echo_repeats_the_input_with_its_logprobs(served, reference):
    """vLLM's echo: a text completion starts with its prompt, and with
    logprobs the prompt's tokens lead the lists (the first with none, the
    others with their logprob under the model); streamed (n = 1 and 2) it
    adds up to the same; chat repeats a final assistant message."""
    import json

    import httpx

    url = served.base_url
    body = {"model": "tiny", "prompt": "One two three", "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    plain = httpx.post(url + "/v1/completions", timeout=60, json=body).json()["choices"][0]["text"]
    echoed = httpx.post(url + "/v1/completions", timeout=60, json={**body, "echo": True, "logprobs": 2}).json()
    choice = echoed["choices"][0]
    assert choice["text"] == "One two three" + plain
    lp = choice["logprobs"]
    ids = httpx.post(url + "/tokenize", json={"prompt": body["prompt"]}, timeout=10).json()["tokens"]
    assert "".join(lp["tokens"]) == choice["text"] and len(lp["tokens"]) == len(ids) + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    with torch.no_grad():
        expected = reference.model(input_ids=torch.tensor([ids])).logits[0].log_softmax(-1)
    for position in range(1, len(ids)):
        token = ids[position]
        assert abs(lp["token_logprobs"][position] - expected[position - 1, token].item()) <= 1e-4
        assert lp["tokens"][position] in lp["top_logprobs"][position]
    for n in (1, 2):
        with httpx.stream("POST", url + "/v1/completions", timeout=60,
                          json={**body, "echo": True, "logprobs": 2, "stream": True, "n": n}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        for index in range(n):
            mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == index]
            assert "".join(c["text"] for c in mine) == choice["text"]
            assert [t for c in mine if c["logprobs"] for t in c["logprobs"]["tokens"]] == lp["tokens"]
            assert [o for c in mine if c["logprobs"] for o in c["logprobs"]["text_offset"]] == lp["text_offset"]
    as_ids = httpx.post(url + "/v1/completions", timeout=60, json={**body, "prompt": ids, "echo": True}).json()
    assert as_ids["choices"][0]["text"] == "One two three" + plain
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is"}]
    chat = {"model": "tiny", "messages": turns, "max_tokens": 3, "temperature": 0, "ignore_eos": True,
            "add_generation_prompt": False, "continue_final_message": True}
    alone = httpx.post(url + "/v1/chat/completions", timeout=60, json=chat).json()["choices"][0]["message"]["content"]
    whole = httpx.post(url + "/v1/chat/completions", timeout=60, json={**chat, "echo": True}).json()
    assert whole["choices"][0]["message"]["content"] == "The answer is" + alone
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=60, json={**chat, "echo": True, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == \
        "The answer is" + alone
    user_last = {**chat, "messages": turns[:1], "add_generation_prompt": True, "continue_final_message": False}
    assert httpx.post(url + "/v1/chat/completions", timeout=60, json={**user_last, "echo": True}).json()[
        "choices"][0]["message"]["content"] == httpx.post(url + "/v1/chat/completions", timeout=60,
                                                           json=user_last).json()["choices"][0]["message"]["content"]


def test_return_token_ids_gives_the_prompt_and_each_choice_as_ids(served):
    """vLLM's return_token_ids (proxy/token_ids.py): whole and streamed, chat
    and text completions, n of 2; the ids are /tokenize's for the prompt and
    detokenize to the answer's text."""
    import json

    import httpx

    def post(path, body):
        return httpx.post(served.base_url + path, timeout=60, json=body).json()

    def chunks(path, body):
        with httpx.stream("POST", served.base_url + path, timeout=60, json={**body, "stream": True}) as r:
            return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]

    text = {"model": "tiny", "prompt": "One two", "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    prompt = post("/tokenize", {"model": "tiny", "prompt": "One two"})["tokens"]
    whole = post("/v1/completions", {**text, "n": 2})
    for choice in whole["choices"]:
        assert choice["prompt_token_ids"] == prompt and len(choice["token_ids"]) == 5
        assert post("/detokenize", {"model": "tiny", "tokens": choice["token_ids"]})["prompt"] == choice["text"]
    streamed = [c for c in chunks("/v1/completions", {**text, "n": 2}) if c["choices"]]
    for index in (0, 1):
        mine = [c["choices"][0] for c in streamed if c["choices"][0]["index"] == index]
        assert mine[0]["prompt_token_ids"] == prompt and all("prompt_token_ids" not in c for c in mine[1:])
        assert [t for c in mine for t in c["token_ids"]] == whole["choices"][index]["token_ids"]   # greedy

    chat = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    rendered = post("/tokenize", {"model": "tiny", "messages": chat["messages"]})["tokens"]
    answer = post("/v1/chat/completions", chat)
    assert answer["prompt_token_ids"] == rendered and "prompt_token_ids" not in answer["choices"][0]
    ids = answer["choices"][0]["token_ids"]
    assert len(ids) == answer["usage"]["completion_tokens"] == 4
    assert post("/detokenize", {"model": "tiny", "tokens": ids})["prompt"] == answer["choices"][0]["message"]["content"]
    pieces = chunks("/v1/chat/completions", chat)
    assert pieces[0]["prompt_token_ids"] == rendered and pieces[0]["choices"][0]["delta"]["role"] == "assistant"
    assert [t for c in pieces[1:] if c["choices"] for t in c["choices"][0]["token_ids"]] == ids
    plain = post("/v1/chat/completions", {**chat, "return_token_ids": False})
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
