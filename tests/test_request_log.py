"""Operating flags on a real stack (the tiny model): the proxy's line per
finished request as JSON (--log-format json: the client's X-Request-Id, how
it ended, its tokens and where its time went), stages that take
--log-level, and --max-model-len."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from e2e_helpers import chat_messages, serving
from stack import Stack


@pytest.fixture(scope="module")
def logged(tmp_path_factory, tiny_dir):
    yield from serving(Stack(tmp_path_factory.mktemp("logged"), tiny_dir, encoders=1, generators=1,
                             proxy_args=("--log-format", "json", "--max-model-len", "300"),
                             generator_args=("--log-level", "warning")))


def test_a_finished_request_is_one_json_line_with_its_id_tokens_and_phases(logged):
    r = httpx.post(logged.base_url + "/v1/chat/completions", timeout=60, headers={"X-Request-Id": "client-id-42"},
                   json={"model": "tiny", "messages": chat_messages([], "log me"), "max_tokens": 5,
                         "ignore_eos": True})
    assert r.status_code == 200 and r.headers["X-Request-Id"] == "client-id-42"
    assert r.json()["id"] == "chatcmpl-client-id-42"   # vLLM's: the answer named by the id the client sent
    assert logged.wait_for_log('"request_id": "client-id-42"')
    line, = [json.loads(text) for text in logged.whole_log().splitlines()
             if text.startswith("{") and '"request_id": "client-id-42"' in text]
    assert line["logger"] == "epd.requests" and line["level"] == "info"
    assert line["status"] == "length" and line["completion_tokens"] == 5 and line["prompt_tokens"] > 0
    assert 0 <= line["ttft_s"] <= line["e2e_s"]
    assert all(line[phase] >= 0 for phase in ("queue_s", "prefill_s", "decode_s"))
    assert line["queue_s"] + line["prefill_s"] + line["decode_s"] <= line["e2e_s"]
    assert "client-id-42 finished: " in line["message"]

    bad = httpx.post(logged.base_url + "/v1/chat/completions", timeout=60, headers={"X-Request-Id": "client-id-43"},
                     json={"model": "tiny", "messages": chat_messages([], "x"), "max_tokens": 5, "temperature": -1})
    assert bad.status_code == 400            # refused before it was sent on: no line, nothing finished
    # The generator ran at --log-level warning: none of its info lines (its "ready" line) are in the log.
    assert "epd.generator INFO" not in logged.whole_log()


def test_answers_are_named_by_the_request_id_whole_streamed_and_with_n(logged):
    url = logged.base_url + "/v1/completions"
    body = {"model": "tiny", "prompt": "name me", "max_tokens": 3, "ignore_eos": True}
    whole = httpx.post(url, timeout=60, headers={"X-Request-Id": "c-1"}, json={**body, "n": 2}).json()
    assert whole["id"] == "cmpl-c-1" and len(whole["choices"]) == 2
    with httpx.stream("POST", url, timeout=60, headers={"X-Request-Id": "c-2"}, json={**body, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks and {chunk["id"] for chunk in chunks} == {"cmpl-c-2"}
    # The same id twice at once: each answer is whole (our routing ids differ).
    with ThreadPoolExecutor(2) as pool:
        same = list(pool.map(lambda _: httpx.post(url, timeout=60, headers={"X-Request-Id": "dup"},
                                                  json={**body, "max_tokens": 12}).json(), range(2)))
    assert [a["id"] for a in same] == ["cmpl-dup"] * 2 and all(a["usage"]["completion_tokens"] == 12 for a in same)
    # Without one, the id is ours, the same as the X-Request-Id header we answer with.
    r = httpx.post(logged.base_url + "/v1/chat/completions", timeout=60,
                   json={"model": "tiny", "messages": chat_messages([], "x"), "max_tokens": 2})
    assert r.json()["id"] == "chatcmpl-" + r.headers["X-Request-Id"]


def test_max_model_len_bounds_prompt_and_output(logged):
    models = httpx.get(logged.base_url + "/v1/models", timeout=10).json()
    assert models["data"][0]["max_model_len"] == 300
    long = httpx.post(logged.base_url + "/v1/chat/completions", timeout=60,
                      json={"model": "tiny", "messages": chat_messages([], "word " * 200), "max_tokens": 200})
    assert long.status_code == 400 and "maximum context length is 300 tokens" in long.json()["error"]["message"]
    fits = httpx.post(logged.base_url + "/v1/chat/completions", timeout=60,
                      json={"model": "tiny", "messages": chat_messages([], "short"), "max_tokens": 8})
    assert fits.status_code == 200


QUIET = """
import sys
from types import SimpleNamespace
from pipeline import protocol
from pipeline.logs import setup_logging
from pipeline.proxy.request_log import log_finished
import pipeline.generator.service as generator_service, pipeline.encoder.periodic as encoder_periodic
setup_logging("info", "text", disable_stats=sys.argv[1] == "1", disable_requests=sys.argv[2] == "1")
work = SimpleNamespace(client_id="", request=SimpleNamespace(request_id="r1"))
flight = SimpleNamespace(work=work, tokens=3, created=0.0, generator="g0", attempt=0, first_token_at=None)
log_finished(flight, protocol.TokenDelta("r1", (), "", True, "stop", 5, 3), 1.0)
log_finished(flight, protocol.TokenDelta("r1", (), "", True, "error", 5, 0, error="it broke", status=500), 1.0)
for stats in (generator_service.stats_log, encoder_periodic.stats_log):
    stats.info("%s profile line", stats.name)
"""


@pytest.mark.parametrize("stats, requests", [(False, False), (True, False), (False, True), (True, True)])
def test_vllms_disable_log_flags_quiet_the_stats_and_request_lines_but_not_failures(stats, requests):
    import subprocess
    import sys

    from conftest import REPO

    run = subprocess.run([sys.executable, "-c", QUIET, str(int(stats)), str(int(requests))], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    log = run.stderr
    assert ("epd.stats INFO epd.stats profile line" in log) is not stats and log.count("profile line") in (0, 2)
    assert ("status=stop" in log) is not requests
    assert "WARNING request r1 finished" in log and "it broke" in log   # a failure always
