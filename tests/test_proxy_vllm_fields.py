"""vLLM's readings of the OpenAI fields, in-process as test_proxy_http.py
runs the proxy: max_tokens, stream_options, seeds, and vLLM's own
chat_template_kwargs, add_generation_prompt, cache_salt and output options."""

from __future__ import annotations

import asyncio
import re
import time

import pytest

from pipeline.proxy.api_types import parse_body
from pipeline.proxy.requests import completion_work
from test_proxy_http import CHAT, chat_body, serve


def test_max_tokens_as_vllm_reads_it(tiny_dir):
    """Completions default to 16 tokens (the legacy API's default); null,
    and chat, to the room left; 0 or less is a 400, not "unset"."""
    import json

    import pipeline.proxy.api_types as api
    from pipeline.processing.processor import Processor
    from pipeline.proxy.requests import ModelInfo, chat_work

    model = ModelInfo("tiny", Processor.from_checkpoint(tiny_dir, image_token_id=0), 512, b"salt")

    def max_tokens(kind: str, **fields) -> int:
        body = {"prompt": "x"} if kind == "completion" else {"messages": [{"role": "user", "content": "hi"}]}
        req = parse_body(json.dumps({**body, **fields}).encode(), kind)
        made = completion_work(req, model, "r", "inproc://proxy", req.prompt) if kind == "completion" else chat_work(
            req, model, None, "r", "inproc://proxy")
        work = asyncio.run(made)
        return work.request.sampling.max_tokens, len(work.request.prompt_token_ids)

    assert max_tokens("completion")[0] == 16
    tokens, prompt = max_tokens("completion", max_tokens=None)
    assert tokens == 512 - prompt
    tokens, prompt = max_tokens("chat")
    assert tokens == 512 - prompt
    assert max_tokens("chat", max_completion_tokens=5, max_tokens=9)[0] == 5
    for kind, field, value in (("completion", "max_tokens", 0), ("chat", "max_tokens", -2),
                               ("chat", "max_completion_tokens", 0)):
        with pytest.raises(api.ApiError, match=f"{field} must be at least 1, got {value}") as caught:
            max_tokens(kind, **{field: value})
        assert caught.value.param == field and caught.value.status == 400
    with pytest.raises(api.ApiError, match="maximum context length is 512"):
        max_tokens("chat", max_tokens=600)


def test_chat_template_kwargs_and_add_generation_prompt_reach_the_template(tiny_dir):
    import json

    import pipeline.proxy.api_types as api
    from pipeline.processing.processor import Processor
    from pipeline.proxy.requests import ModelInfo, chat_work

    template = ("{% for m in messages %}[{{ m.content }}]{% endfor %}{% if shout %}LOUD{% endif %}"
                "{% if add_generation_prompt %}ASSISTANT:{% endif %}")
    processor = Processor.from_checkpoint(tiny_dir, image_token_id=0, chat_template=template)
    model = ModelInfo("tiny", processor, 512, b"salt")

    def prompt(**fields) -> str:
        req = parse_body(json.dumps(chat_body(**fields)).encode(), "chat")
        ids = asyncio.run(chat_work(req, model, None, "r", "inproc://proxy")).request.prompt_token_ids
        return processor.tokenizer.decode(ids, skip_special_tokens=False)

    assert prompt() == "[hi]ASSISTANT:"
    assert prompt(chat_template_kwargs={"shout": True}, add_generation_prompt=False) == "[hi]LOUD"
    with pytest.raises(api.ApiError, match="may not set add_generation_prompt, messages") as caught:
        prompt(chat_template_kwargs={"messages": [], "add_generation_prompt": False})
    assert caught.value.param == "chat_template_kwargs"


def test_a_seed_past_what_the_wire_holds_is_a_400_and_a_request_that_cannot_be_sent_holds_no_slot(tiny_dir, tmp_path):
    import json

    import pipeline.proxy.api_types as api
    from pipeline.sampling_params import MAX_SEED, SamplingParams

    parse_body(json.dumps(chat_body(seed=MAX_SEED)).encode(), "chat")
    for fields in (dict(seed=MAX_SEED + 1), dict(seed=MAX_SEED, n=2), dict(seed=-1)):
        with pytest.raises(api.ApiError, match="seed must be in") as caught:
            parse_body(json.dumps(chat_body(**fields)).encode(), "chat")
        assert caught.value.param == "seed"
    with pytest.raises(ValueError, match="seed must be at most"):
        SamplingParams(max_tokens=4, seed=MAX_SEED + 1)

    async def scenario(client, app):
        dispatcher = next(r.handler.__self__ for r in app.router.routes()
                          if getattr(r.handler, "__name__", "") == "chat").dispatcher
        dispatcher.last_seen[dispatcher.generators[0]] = time.monotonic() + 3600   # up

        def unsendable(address, message):
            raise OverflowError("can't serialize")

        dispatcher.outbox.try_send = unsendable
        r = await client.post(CHAT, json=chat_body())
        assert r.status == 500 and not dispatcher.flights and not any(dispatcher.load.values())

    serve(tiny_dir, tmp_path, scenario=scenario)


def test_stream_options_as_vllm_reads_them():
    import json

    import pipeline.proxy.api_types as api

    def parsed(**fields):
        return parse_body(json.dumps(chat_body(**fields)).encode(), "chat")

    assert parsed(stream=True, stream_options={}).stream_options.include_usage is True
    assert parsed(stream=True, stream_options={"include_usage": False}).stream_options.include_usage is False
    with pytest.raises(api.ApiError, match="only be set when stream is true") as caught:
        parsed(stream_options={"include_usage": True})
    assert caught.value.param == "stream_options"
    assert parsed(stream=True, stream_options={"continuous_usage_stats": True}).stream_options.continuous_usage_stats


def test_cache_salt_reaches_the_generate_request_and_an_empty_one_is_a_400(tiny_dir):
    import json

    import pipeline.proxy.api_types as api
    from pipeline.processing.processor import Processor
    from pipeline.proxy.requests import ModelInfo

    model = ModelInfo("tiny", Processor.from_checkpoint(tiny_dir, image_token_id=0), 512, b"salt")

    def salt_of(**fields) -> str:
        req = parse_body(json.dumps({"prompt": "x", **fields}).encode(), "completion")
        return asyncio.run(completion_work(req, model, "r", "inproc://proxy", req.prompt)).request.cache_salt

    assert salt_of() == "" and salt_of(cache_salt="tenant-a") == "tenant-a"
    with pytest.raises(api.ApiError, match="cache_salt must be a non-empty string") as caught:
        salt_of(cache_salt="")
    assert caught.value.param == "cache_salt" and caught.value.status == 400


def test_vllm_output_options_reach_the_sampling_and_bad_allowed_ids_are_400s(tiny_dir):
    import json

    import pipeline.proxy.api_types as api
    from pipeline.processing.processor import Processor
    from pipeline.proxy.requests import ModelInfo

    model = ModelInfo("tiny", Processor.from_checkpoint(tiny_dir, image_token_id=0), 512, b"salt")
    vocab = model.processor.tokenizer.vocab_size

    def sampling(**fields):
        req = parse_body(json.dumps({"prompt": "x", **fields}).encode(), "completion")
        return asyncio.run(completion_work(req, model, "r", "inproc://proxy", req.prompt)).request.sampling

    plain = sampling()
    assert (plain.allowed_token_ids, plain.include_stop_str_in_output, plain.skip_special_tokens) == ((), False, True)
    asked = sampling(allowed_token_ids=[9, 3, 9], include_stop_str_in_output=True, skip_special_tokens=False,
                     spaces_between_special_tokens=False)
    assert (asked.allowed_token_ids, asked.include_stop_str_in_output, asked.skip_special_tokens) == \
        ((9, 3, 9), True, False)
    for ids, says in (([], "at least one"), ([vocab], f"[0, {vocab})"), ([-1], "-1 is not")):
        with pytest.raises(api.ApiError, match=re.escape(says)) as caught:
            sampling(allowed_token_ids=ids)
        assert caught.value.param == "allowed_token_ids" and caught.value.status == 400


def test_continue_final_message_and_add_special_tokens_shape_the_prompt(tiny_dir, tmp_path):
    """A checkpoint whose tokenizer puts a BOS (here <|im_start|>) before
    every text: vLLM's add_special_tokens adds it (default on for
    completions, off for chat); continue_final_message ends the prompt
    inside the final message."""
    import json
    import shutil

    import pipeline.proxy.api_types as api
    from pipeline.processing.processor import Processor
    from pipeline.proxy.requests import ModelInfo, chat_work

    folder = shutil.copytree(tiny_dir, tmp_path / "bos")
    spec = json.loads((folder / "tokenizer.json").read_text())
    bos = next(t["id"] for t in spec["added_tokens"] if t["content"] == "<|im_start|>")
    spec["post_processor"] = {"type": "TemplateProcessing",
                              "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
                                         {"Sequence": {"id": "A", "type_id": 0}}],
                              "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                              "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [bos],
                                                                  "tokens": ["<|im_start|>"]}}}
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    model = ModelInfo("tiny", Processor.from_checkpoint(folder, image_token_id=0), 512, b"salt")
    tokenizer = model.processor.tokenizer

    def ids(kind: str, **fields) -> list[int]:
        req = parse_body(json.dumps(fields).encode(), kind)
        made = (completion_work(req, model, "r", "inproc://proxy", req.prompt) if kind == "completion"
                else chat_work(req, model, None, "r", "inproc://proxy"))
        return list(asyncio.run(made).request.prompt_token_ids)

    words = tokenizer.encode("one two")
    assert ids("completion", prompt="one two") == [bos, *words]
    assert ids("completion", prompt="one two", add_special_tokens=False) == words
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is"}]
    plain = ids("chat", messages=turns, add_generation_prompt=False)
    assert ids("chat", messages=turns, add_generation_prompt=False, add_special_tokens=True) == [bos, *plain]
    continued = ids("chat", messages=turns, add_generation_prompt=False, continue_final_message=True)
    assert tokenizer.decode(continued, skip_special_tokens=False).endswith("assistant\nThe answer is")
    assert plain[:len(continued)] == continued and len(plain) > len(continued)   # the end of turn went
    with pytest.raises(api.ApiError, match="add_generation_prompt false") as caught:
        ids("chat", messages=turns, continue_final_message=True)
    assert caught.value.param == "continue_final_message" and caught.value.status == 400


def test_bad_words_become_token_sequences_at_the_start_and_mid_text(tiny_dir):
    import json

    import pipeline.proxy.api_types as api
    from pipeline.processing.processor import Processor
    from pipeline.proxy.requests import ModelInfo
    from pipeline.proxy.sampling_fields import bad_words_token_ids

    model = ModelInfo("tiny", Processor.from_checkpoint(tiny_dir, image_token_id=0), 512, b"salt")
    tokenizer = model.processor.tokenizer
    words = ["cat", " sky tree"]
    found = bad_words_token_ids(words, tokenizer)
    expected = []
    for word in words:
        bare, spaced = tuple(tokenizer.encode(word.lstrip())), tuple(tokenizer.encode(" " + word.lstrip()))
        expected += [bare] + ([spaced] if spaced[0] != bare[0] and len(spaced) == len(bare) else [])
    assert found == tuple(expected) and len(found) > len(words)   # some word has its mid-text form too
    req = parse_body(json.dumps({"prompt": "x", "bad_words": words}).encode(), "completion")
    sampling = asyncio.run(completion_work(req, model, "r", "inproc://proxy", req.prompt)).request.sampling
    assert sampling.bad_words_token_ids == found
    with pytest.raises(api.ApiError, match="non-empty") as caught:
        bad_words_token_ids(["  "], tokenizer)
    assert caught.value.param == "bad_words"


def test_truncate_prompt_tokens_keeps_the_prompts_end_and_never_cuts_its_images(tiny_dir):
    import json

    import pipeline.proxy.api_types as api
    from pipeline.processing.processor import Processor
    from pipeline.proxy.requests import ModelInfo, chat_work

    from conftest import image_bytes, random_image
    from e2e_helpers import chat_messages
    from pipeline.proxy.media_fetch import FetchPolicy

    image_token = json.loads((tiny_dir / "config.json").read_text())["image_token_id"]
    model = ModelInfo("tiny", Processor.from_checkpoint(tiny_dir, image_token_id=image_token), 512, b"salt")

    def prompt_of(kind: str, **fields):
        req = parse_body(json.dumps(fields).encode(), kind)
        made = (completion_work(req, model, "r", "inproc://proxy", req.prompt) if kind == "completion"
                else chat_work(req, model, FetchPolicy(), "r", "inproc://proxy"))
        return asyncio.run(made).request

    ids = model.processor.tokenizer.encode("one two three four five six")
    assert list(prompt_of("completion", prompt=ids, truncate_prompt_tokens=3).prompt_token_ids) == ids[-3:]
    assert list(prompt_of("completion", prompt=ids, truncate_prompt_tokens=-1).prompt_token_ids) == ids
    assert list(prompt_of("completion", prompt=ids, truncate_prompt_tokens=99).prompt_token_ids) == ids
    messages = chat_messages([image_bytes(random_image(64, 64, seed=1))], "What is it? Say it in many words.")
    whole = prompt_of("chat", messages=messages)
    start, length = whole.image_spans[0]
    keep = len(whole.prompt_token_ids) - start   # the image and all after it
    kept = prompt_of("chat", messages=messages, truncate_prompt_tokens=keep)
    assert kept.prompt_token_ids == whole.prompt_token_ids[start:] and kept.image_spans == ((0, length),)
    assert kept.image_keys == whole.image_keys
    for value, says in ((keep - 1, "would cut the prompt's images"), (0, "must be -1 or in"), (513, "must be -1")):
        with pytest.raises(api.ApiError, match=says) as caught:
            prompt_of("chat", messages=messages, truncate_prompt_tokens=value)
        assert caught.value.param == "truncate_prompt_tokens" and caught.value.status == 400


def test_documents_reach_a_template_that_takes_them_and_are_a_400_otherwise(tiny_dir):
    import json

    import pipeline.proxy.api_types as api
    from pipeline.processing.processor import Processor
    from pipeline.proxy.requests import ModelInfo, chat_work

    rag = ("{% for d in documents %}<doc {{ d.title }}>{{ d.text }}</doc>{% endfor %}"
           "{% for m in messages %}[{{ m.content }}]{% endfor %}")

    def prompt(template: str | None, **fields) -> str:
        processor = Processor.from_checkpoint(tiny_dir, image_token_id=0, chat_template=template)
        model = ModelInfo("tiny", processor, 512, b"salt")
        req = parse_body(json.dumps({"messages": [{"role": "user", "content": "hi"}], **fields}).encode(), "chat")
        work = asyncio.run(chat_work(req, model, None, "r", "inproc://proxy"))
        return processor.tokenizer.decode(work.request.prompt_token_ids, skip_special_tokens=False)

    docs = [{"title": "a", "text": "alpha"}, {"title": "b", "text": "beta"}]
    assert prompt(rag, documents=docs) == "<doc a>alpha</doc><doc b>beta</doc>[hi]"
    with pytest.raises(api.ApiError, match="takes no documents") as caught:
        prompt(None, documents=docs)   # the tiny checkpoint's own template never reads them
    assert caught.value.param == "documents" and caught.value.status == 400
    assert "alpha" not in prompt(None)


def test_a_requests_chat_template_only_where_the_server_trusts_it(tiny_dir):
    import json

    import pipeline.proxy.api_types as api
    from pipeline.processing.processor import Processor
    from pipeline.proxy.requests import ModelInfo, chat_work

    processor = Processor.from_checkpoint(tiny_dir, image_token_id=0)

    def prompt(trust: bool, **fields) -> str:
        model = ModelInfo("tiny", processor, 512, b"salt", trust_request_chat_template=trust)
        req = parse_body(json.dumps({"messages": [{"role": "user", "content": "hi"}], **fields}).encode(), "chat")
        work = asyncio.run(chat_work(req, model, None, "r", "inproc://proxy"))
        return processor.tokenizer.decode(work.request.prompt_token_ids, skip_special_tokens=False)

    own = "{% for m in messages %}<<{{ m.role }}:{{ m.content }}>>{% endfor %}{{ eos_token }}"
    eos = prompt(True, chat_template="{{ eos_token }}")   # the checkpoint's special tokens stay its variables
    assert eos and prompt(True, chat_template=own) == "<<user:hi>>" + eos
    assert prompt(True) == prompt(False) == processor.tokenizer.decode(
        processor.tokenizer.encode(processor.template.render([{"role": "user", "content": "hi"}])),
        skip_special_tokens=False)
    for trust, source, says in ((False, own, "--trust-request-chat-template"), (True, "{% for %}", "does not compile")):
        with pytest.raises(api.ApiError, match=says) as caught:
            prompt(trust, chat_template=source)
        assert caught.value.param == "chat_template" and caught.value.status == 400
