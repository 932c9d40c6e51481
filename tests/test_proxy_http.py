"""The proxy's HTTP surface in-process (aiohttp's test server, the tiny
model's processor, generators that never answer): what it refuses and how,
model names, the API key, CORS, request ids, the JSON error shape, and
/tokenize, /detokenize, /version. Everything here is answered before a
request would reach a stage."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp.test_utils import TestClient, TestServer

from pipeline import protocol
from pipeline.proxy.api_types import NOT_YET_SUPPORTED, ApiError, parse_body
from pipeline.proxy.requests import completion_work
from stages.proxy import build_app, parse_args

CHAT = "/v1/chat/completions"


def serve(tiny_dir, tmp_path, *flags, scenario):
    """Run `scenario(client, app)` against a proxy built from these flags."""
    args = parse_args(["--model", str(tiny_dir), "--model-id", "tiny", "--mode", "aggregated",
                       "--generators", f"ipc://{tmp_path}/nobody.sock", "--address", f"ipc://{tmp_path}/proxy.sock",
                       *flags])

    async def run():
        app = build_app(args)
        async with TestClient(TestServer(app)) as client:
            await scenario(client, app)

    asyncio.run(run())


def chat_body(**extra) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}


REFUSED = {
    "functions": [{"name": "f"}], "function_call": "auto",
    "best_of": 2,
    "logits_processors": ["mod.Proc"],
    "modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"},
    "prediction": {"type": "content", "content": "x"}, "web_search_options": {},
    "verbosity": "low", "store": True, "service_tier": "flex",
    "vllm_xargs": {"k": 1}, "use_beam_search": True, "length_penalty": 0.5,
    "kv_transfer_params": {"do_remote_decode": True},
}


def test_a_field_no_api_defines_is_ignored_with_one_warning_per_set_of_names(caplog):
    import json

    import pipeline.proxy.api_types as api

    from pipeline.proxy.ignored_fields import _warn

    _warn.cache_clear()
    body = chat_body(zz_newer_field=1, aa_other={"x": [1, 2]})
    with caplog.at_level("WARNING", logger="epd.proxy"):
        for _ in range(3):
            req = parse_body(json.dumps(body).encode(), "chat")
    assert req.max_tokens == 4   # the rest of the request as sent
    lines = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert lines == ["the following fields were present in the request but ignored (no API served here defines "
                     "them): aa_other, zz_newer_field (ChatCompletionRequest)"]
    with caplog.at_level("WARNING", logger="epd.proxy"):
        parse_body(json.dumps(chat_body(logprobs=True)).encode(), "chat")   # every field known: no line
    assert len([r for r in caplog.records if "ignored" in r.getMessage()]) == 1
    from pipeline.proxy.responses_request import parse_responses_body
    with caplog.at_level("WARNING", logger="epd.proxy"):
        assert parse_responses_body(json.dumps({"input": "hi", "zz_newer": 1}).encode()).input == "hi"
    assert caplog.records[-1].getMessage().endswith("zz_newer (ResponsesRequest)")
    with pytest.raises(api.ApiError, match="unknown field"):   # a nested Struct that forbids them still does
        parse_body(json.dumps(chat_body(structured_outputs={"regex": "a", "typo": 1})).encode(), "chat")


def test_every_field_not_acted_on_is_refused_by_name_and_neutral_values_pass():
    assert set(REFUSED) | {"suffix"} == set(NOT_YET_SUPPORTED)   # "suffix": refused for completions below
    import json

    import pipeline.proxy.api_types as api

    for field, value in REFUSED.items():
        with pytest.raises(api.ApiError) as caught:
            parse_body(json.dumps(chat_body(**{field: value})).encode(), "chat")
        assert caught.value.param == field and f"'{field}'" in str(caught.value) and caught.value.status == 400
    neutral = dict(tools=[], tool_choice="none", logprobs=False, top_logprobs=0,
                   best_of=1, parallel_tool_calls=True, modalities=["text"], verbosity="medium", store=False,
                   service_tier="auto", audio=None, user="u-1", safety_identifier="s", prompt_cache_key="k",
                   metadata={"team": "a"}, reasoning_effort="low", use_beam_search=False, length_penalty=1.0,
                   vllm_xargs=None, kv_transfer_params=None)
    parse_body(json.dumps(chat_body(**neutral)).encode(), "chat")
    for field, value in (("reasoning_effort", "extreme"), ("metadata", {str(i): "v" for i in range(17)}),
                         ("metadata", {"k": 1})):
        with pytest.raises(api.ApiError, match=field):
            parse_body(json.dumps(chat_body(**{field: value})).encode(), "chat")
    parse_body(json.dumps({"prompt": "x", "user": "u-1"}).encode(), "completion")
    for field, value in (("suffix", "tail"), ("tools", [{"type": "function"}]),
                         ("tool_choice", "auto")):
        with pytest.raises(api.ApiError, match=f"'{field}'"):
            parse_body(json.dumps({"prompt": "x", field: value}).encode(), "completion")


@pytest.mark.parametrize("status, kind", [
    (400, "BadRequestError"), (401, "AuthenticationError"), (404, "NotFoundError"), (413, "BadRequestError"),
    (429, "RateLimitError"), (500, "InternalServerError"), (503, "ServiceUnavailableError"),
    (502, "InternalServerError")])
def test_an_errors_type_follows_its_status_as_vllm_names_them(status, kind):
    assert ApiError("x", status).body()["error"] == {"message": "x", "type": kind, "param": None, "code": status}


def test_top_k_minus_one_is_off_and_below_is_refused(tiny_dir, tmp_path):
    import json

    import pipeline.proxy.api_types as api
    from pipeline.proxy.requests import ModelInfo
    from pipeline.processing.processor import Processor

    processor = Processor.from_checkpoint(tiny_dir, image_token_id=0)
    model = ModelInfo("tiny", processor, 512, b"salt")
    for top_k in (-1, 0):
        req = parse_body(json.dumps({"prompt": "x", "top_k": top_k, "max_tokens": 2}).encode(), "completion")
        work = asyncio.run(completion_work(req, model, "r", "inproc://proxy", req.prompt))
        assert work.request.sampling.top_k == 0
    with pytest.raises(api.ApiError, match="top_k"):
        parse_body(json.dumps({"prompt": "x", "top_k": -2}).encode(), "completion")


def test_model_names_and_the_404_for_others(tiny_dir, tmp_path):
    async def scenario(client, app):
        r = await client.post(CHAT, json=chat_body(model="gpt-4"))
        assert r.status == 404
        error = (await r.json())["error"]
        assert error["message"] == "The model `gpt-4` does not exist." and error["type"] == "NotFoundError"
        models = await (await client.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["qwen-a", "qwen-b"]
        assert all(m["root"] == "tiny" for m in models["data"])
        assert await (await client.get("/v1/models/qwen-b")).json() == models["data"][1]
        missing = await client.get("/v1/models/tiny")
        assert missing.status == 404
        assert (await missing.json())["error"]["message"] == "The model `tiny` does not exist."
        r = await client.post("/tokenize", json={"model": "tiny", "prompt": "x"})
        assert r.status == 404   # --served-model-name replaces the default name

    serve(tiny_dir, tmp_path, "--served-model-name", "qwen-a", "qwen-b", scenario=scenario)


def test_api_key(tiny_dir, tmp_path):
    async def scenario(client, app):
        assert (await client.get("/v1/models")).status == 401
        wrong = await client.get("/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status == 401 and (await wrong.json())["error"]["type"] == "AuthenticationError"
        assert (await client.get("/v1/models", headers={"Authorization": "Bearer s3cret"})).status == 200
        assert (await client.get("/v1/models/tiny")).status == 401
        assert (await client.post("/tokenize", json={"prompt": "x"})).status == 401
        assert (await client.post("/invocations", json={"prompt": "x"})).status == 401
        assert (await client.get("/version")).status == 200   # only the API routes by default
        assert (await client.get("/ping")).status == (await client.get("/health")).status != 401

    serve(tiny_dir, tmp_path, "--api-key", "s3cret", scenario=scenario)

    async def all_routes(client, app):
        assert (await client.get("/version")).status == 401
        assert (await client.get("/metrics")).status == 401
        assert (await client.get("/version", headers={"Authorization": "Bearer s3cret"})).status == 200

    serve(tiny_dir, tmp_path, "--api-key", "s3cret", "--api-key-all-routes", scenario=all_routes)


def test_cors_preflight_and_headers(tiny_dir, tmp_path):
    async def scenario(client, app):
        preflight = await client.options(CHAT, headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type, authorization"})
        assert preflight.status == 200
        assert preflight.headers["Access-Control-Allow-Origin"] == "https://app.example"
        assert "POST" in preflight.headers["Access-Control-Allow-Methods"]
        plain = await client.get("/v1/models", headers={"Origin": "https://app.example",
                                                        "Authorization": "Bearer k"})
        assert plain.headers["Access-Control-Allow-Origin"] == "https://app.example"
        other = await client.options(CHAT, headers={"Origin": "https://evil.example",
                                                    "Access-Control-Request-Method": "POST"})
        assert other.status == 403

    serve(tiny_dir, tmp_path, "--api-key", "k", "--allowed-origins", '["https://app.example"]', scenario=scenario)


def test_request_ids_and_the_json_error_shape(tiny_dir, tmp_path):
    async def scenario(client, app):
        r = await client.get("/v1/models", headers={"X-Request-Id": "abc-123"})
        assert r.headers["X-Request-Id"] == "abc-123"
        made = (await client.get("/v1/models")).headers["X-Request-Id"]
        assert len(made) == 32 and made != (await client.get("/v1/models")).headers["X-Request-Id"]
        missing = await client.get("/v1/nothing-here", headers={"X-Request-Id": "r404"})
        assert missing.status == 404 and missing.headers["X-Request-Id"] == "r404"
        error = (await missing.json())["error"]
        assert error["code"] == 404 and "/v1/nothing-here" in error["message"] and error["type"] == "NotFoundError"
        wrong_method = await client.get(CHAT)
        assert wrong_method.status == 405 and (await wrong_method.json())["error"]["code"] == 405
        refused = await client.post(CHAT, json=chat_body(function_call="auto"))
        assert refused.status == 400 and (await refused.json())["error"]["param"] == "function_call"
        assert (await refused.json())["error"]["type"] == "BadRequestError"   # vLLM's type names

    serve(tiny_dir, tmp_path, scenario=scenario)


def test_an_internal_failure_is_a_json_500_that_leaks_nothing(tiny_dir, tmp_path):
    async def scenario(client, app):
        # The chat route's handler is the ProxyApp's bound method: its dispatcher is the one to break.
        dispatcher = next(r.handler.__self__ for r in app.router.routes()
                          if getattr(r.handler, "__name__", "") == "chat").dispatcher

        def broken(work):
            raise RuntimeError("database password is hunter2")

        dispatcher.submit = broken
        r = await client.post(CHAT, json=chat_body(), headers={"X-Request-Id": "boom-1"})
        assert r.status == 500
        body = await r.json()
        assert body["error"]["type"] == "InternalServerError" and "boom-1" in body["error"]["message"]
        assert "hunter2" not in await r.text() and "Traceback" not in await r.text()
        assert (await client.get("/v1/models")).status == 200   # and it goes on serving

    serve(tiny_dir, tmp_path, scenario=scenario)


def test_a_failure_after_a_request_was_sent_on_aborts_it_at_its_generator(tiny_dir, tmp_path):
    async def scenario(client, app):
        proxy = next(r.handler.__self__ for r in app.router.routes()
                     if getattr(r.handler, "__name__", "") == "chat")
        dispatcher = proxy.dispatcher
        dispatcher.last_seen[dispatcher.generators[0]] = time.monotonic() + 3600   # up
        submit, abort, aborted = dispatcher.submit, dispatcher.abort, []

        def answered(work):
            flight = submit(work)
            flight.deltas.put_nowait(protocol.TokenDelta(work.request.request_id, (5,), "x"))
            return flight

        async def broken(*args):
            raise RuntimeError("a bug while answering")

        dispatcher.submit, proxy._whole = answered, broken
        dispatcher.abort = lambda rid: aborted.append(rid) or abort(rid)
        r = await client.post(CHAT, json=chat_body())
        assert r.status == 500 and len(aborted) == 1 and not dispatcher.flights

    serve(tiny_dir, tmp_path, scenario=scenario)


def test_a_client_that_hangs_up_mid_stream_is_an_abort_not_a_logged_failure(tiny_dir, tmp_path, caplog):
    async def scenario(client, app):
        dispatcher = next(r.handler.__self__ for r in app.router.routes()
                          if getattr(r.handler, "__name__", "") == "chat").dispatcher
        # As if the generator had answered a stats request just now (none answers here).
        dispatcher.last_seen[dispatcher.generators[0]] = time.monotonic()
        # Text only and streamed: the headers leave before any token.
        r = await client.post(CHAT, json=chat_body(stream=True))
        assert r.status == 200 and len(dispatcher.flights) == 1
        r.close()
        deadline = asyncio.get_running_loop().time() + 10
        while dispatcher.flights and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.02)
        assert not dispatcher.flights        # aborted at its generator too
        assert (await client.get("/v1/models")).status == 200

    with caplog.at_level("DEBUG"):
        serve(tiny_dir, tmp_path, scenario=scenario)
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")], \
        [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    (line,) = [r.getMessage() for r in caplog.records if r.name == "epd.requests"]
    assert "aborted (the client hung up)" in line and "status=aborted" in line


def test_a_write_to_a_client_that_hung_up_goes_to_aiohttp_unlogged(caplog):
    """The race the soak found: the client hangs up between two tokens and
    the handler's write fails before the proxy's client watch has noticed.
    The handler has aborted the request; the middleware hands the error to
    aiohttp (which drops the connection quietly) instead of logging an
    internal failure with its traceback and answering a 500 to no one."""
    from aiohttp import ClientConnectionResetError
    from aiohttp.test_utils import make_mocked_request

    from pipeline.proxy.access import AccessPolicy, error_middleware

    async def write_fails(request):
        raise ClientConnectionResetError("Cannot write to closing transport")

    middleware = error_middleware(AccessPolicy())
    with caplog.at_level("DEBUG"), pytest.raises(ConnectionResetError):
        asyncio.run(middleware(make_mocked_request("POST", CHAT), write_fails))
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]


def test_tokenize_detokenize_and_version(tiny_dir, tmp_path):
    from pipeline.processing.processor import Processor

    processor = Processor.from_checkpoint(tiny_dir, image_token_id=0)

    async def scenario(client, app):
        r = await (await client.post("/tokenize", json={"model": "tiny", "prompt": "Hello world"})).json()
        assert r["tokens"] == processor.tokenizer.encode("Hello world") and r["count"] == len(r["tokens"])
        assert r["max_model_len"] > 0
        messages = [{"role": "user", "content": "Hi there"}]
        chat = await (await client.post("/tokenize", json={"messages": messages})).json()
        assert chat["tokens"] == processor.tokenizer.encode(
            processor.template.render(messages, add_generation_prompt=True))
        back = await (await client.post("/detokenize", json={"tokens": r["tokens"]})).json()
        assert back["prompt"] == "Hello world"
        bad = await client.post("/detokenize", json={"tokens": [-1]})
        assert bad.status == 400 and (await bad.json())["error"]["param"] == "tokens"
        both = await client.post("/tokenize", json={"prompt": "x", "messages": messages})
        assert both.status == 400
        turns = [*messages, {"role": "assistant", "content": "Well"}]
        continued = await (await client.post("/tokenize", json={
            "messages": turns, "add_generation_prompt": False, "continue_final_message": True})).json()
        assert continued["tokens"] == processor.tokenizer.encode(processor.template.render(
            turns, add_generation_prompt=False, continue_final_message=True))
        clash = await client.post("/tokenize", json={"messages": turns, "continue_final_message": True})
        assert clash.status == 400 and "cannot both be set" in (await clash.json())["error"]["message"]
        version = await (await client.get("/version")).json()
        assert version["version"]

    serve(tiny_dir, tmp_path, scenario=scenario)


def test_the_logits_processors_reach_the_sampling_and_bad_values_are_400s(tiny_dir):
    import json

    import pipeline.proxy.api_types as api
    from pipeline.processing.processor import Processor
    from pipeline.proxy.requests import ModelInfo

    model = ModelInfo("tiny", Processor.from_checkpoint(tiny_dir, image_token_id=0), 512, b"salt")

    def work(**fields):
        req = parse_body(json.dumps({"prompt": "x", "max_tokens": 2, **fields}).encode(), "completion")
        return asyncio.run(completion_work(req, model, "r", "inproc://proxy", req.prompt)).request.sampling

    s = work(presence_penalty=0.5, frequency_penalty=-1, repetition_penalty=1.2, min_p=0.1,
             logit_bias={"7": 3, "2": -100})
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty, s.min_p) == (0.5, -1, 1.2, 0.1)
    assert s.logit_bias == ((2, -100.0), (7, 3.0))
    off = work()
    assert (off.presence_penalty, off.frequency_penalty, off.repetition_penalty, off.min_p, off.logit_bias) == (
        0.0, 0.0, 1.0, 0.0, ())
    for fields, fragment in ((dict(presence_penalty=2.5), "presence_penalty"), (dict(min_p=1.5), "min_p"),
                             (dict(repetition_penalty=0), "repetition_penalty"),
                             (dict(logit_bias={"x": 1}), "logit_bias keys"),
                             (dict(logit_bias={"99999999": 1}), "logit_bias token id"),
                             (dict(logit_bias={"3": 500}), r"logit_bias\[3\]")):
        with pytest.raises(api.ApiError, match=fragment) as caught:
            work(**fields)
        assert caught.value.status == 400


def test_generation_config_defaults_apply_to_unset_fields_only(tiny_dir, tmp_path):
    import json

    from pipeline.processing.processor import Processor
    from pipeline.proxy.requests import ModelInfo
    from pipeline.proxy.sampling_defaults import sampling_defaults

    (tmp_path / "generation_config.json").write_text(json.dumps({
        "do_sample": True, "temperature": 0.6, "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.05,
        "max_new_tokens": 7, "eos_token_id": [1, 2]}))
    defaults = sampling_defaults(str(tmp_path), tiny_dir)
    assert defaults == {"temperature": 0.6, "top_k": 20, "top_p": 0.8, "repetition_penalty": 1.05, "max_tokens": 7}
    assert sampling_defaults("vllm", tmp_path) == {} and sampling_defaults("auto", tiny_dir) == {}
    model = ModelInfo("tiny", Processor.from_checkpoint(tiny_dir, image_token_id=0), 512, b"salt", defaults=defaults)

    def sampling(**fields):
        req = parse_body(json.dumps({"prompt": "x", **fields}).encode(), "completion")
        return asyncio.run(completion_work(req, model, "r", "inproc://proxy", req.prompt)).request.sampling

    s = sampling()
    assert (s.temperature, s.top_k, s.top_p, s.repetition_penalty, s.max_tokens) == (0.6, 20, 0.8, 1.05, 7)
    s = sampling(temperature=0, top_k=-1, top_p=1.0, repetition_penalty=1.0, max_tokens=3)
    assert (s.temperature, s.top_k, s.top_p, s.repetition_penalty, s.max_tokens) == (0, 0, 1.0, 1.0, 3)
    assert sampling(max_tokens=30).max_tokens == 7   # as vLLM: the checkpoint's default caps what is asked
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": 0.5}))
    with pytest.raises(ValueError, match="top_k must be an integer"):
        sampling_defaults(str(tmp_path), tiny_dir)


def test_override_generation_config_goes_over_the_files_defaults_or_alone(tiny_dir, tmp_path):
    import json

    from pipeline.launch import cli
    from pipeline.launch.plan import HostFacts, plan_stages
    from pipeline.proxy.sampling_defaults import sampling_defaults

    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.8}))
    over = {"temperature": 0.7, "max_new_tokens": 9}
    assert sampling_defaults(str(tmp_path), tiny_dir, over) == {"temperature": 0.7, "top_p": 0.8, "max_tokens": 9}
    assert sampling_defaults("vllm", tmp_path, over) == {"temperature": 0.7, "max_tokens": 9}
    for bad, says in (({"temprature": 1}, "'temprature' is not one of temperature, top_p"),
                      ({"top_k": 1.5}, "--override-generation-config: top_k must be an integer")):
        with pytest.raises(ValueError, match=says):
            sampling_defaults("vllm", tmp_path, bad)
    args = cli.parse_args([str(tiny_dir), "--device", "cpu", "--override-generation-config", '{"top_k": 20}'])
    proxy = next(s for s in plan_stages(cli.build_options(args), HostFacts(gpu_count=0)) if s.role == "proxy")
    assert '--override-generation-config={"top_k": 20}' in proxy.args
    from stages.proxy import parse_args as proxy_args
    assert proxy_args(list(proxy.args)).override_generation_config == {"top_k": 20}


def test_chat_template_gives_a_checkpoint_without_tools_a_template_that_takes_them(tiny_dir, tmp_path):
    """The tiny checkpoint's own template reads no tools (a 400); with
    --chat-template (a file, or the template itself), the same request renders."""
    from tool_templates import QWEN3_VL_TOOLS

    tools = [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    body = {"model": "tiny", "messages": [{"role": "user", "content": "what time is it"}], "tools": tools}

    async def refused(client, app):
        r = await client.post("/tokenize", json=body)
        assert r.status == 400 and "takes no tools" in (await r.json())["error"]["message"]

    async def rendered(client, app):
        r = await client.post("/tokenize", json=body)
        assert r.status == 200, await r.text()
        assert (await r.json())["count"] > 20    # the tools' definitions are in the prompt

    serve(tiny_dir, tmp_path, scenario=refused)
    template = tmp_path / "tools.jinja"
    template.write_text(QWEN3_VL_TOOLS)
    serve(tiny_dir, tmp_path, "--chat-template", str(template), scenario=rendered)
    serve(tiny_dir, tmp_path, "--chat-template", QWEN3_VL_TOOLS, scenario=rendered)


def test_sagemakers_ping_and_invocations_routes(tiny_dir, tmp_path):
    """As vllm serve has them: /ping answers as /health does (GET and POST);
    /invocations is chat for a body with messages, a text completion for one
    with a prompt, and a 400 for neither."""
    async def scenario(client, app):
        health = await client.get("/health")
        for ping in (await client.get("/ping"), await client.post("/ping")):
            assert ping.status == health.status and await ping.json() == await health.json()
        chat = await client.post("/invocations", json={"model": "tiny", "messages": []})
        assert chat.status == 400 and (await chat.json())["error"]["message"] == "messages must be a non-empty list"
        completion = await client.post("/invocations", json={"model": "tiny", "prompt": "x", "suffix": "y"})
        assert completion.status == 400 and (await completion.json())["error"]["param"] == "suffix"
        neither = await client.post("/invocations", json={"model": "tiny"})
        assert neither.status == 400 and "messages" in (await neither.json())["error"]["message"]

    serve(tiny_dir, tmp_path, scenario=scenario)
