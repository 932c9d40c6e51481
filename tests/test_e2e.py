"""The whole EPD path with real processes and the official openai SDK:
answers equal offline generation, dedup, metrics, aborts and bad input.
Failures of stages are in test_e2e_failover.py."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import REPO, image_bytes, random_image
from e2e_helpers import IMAGES, chat, chat_messages, client, serving
from pipeline.cpu_threads import threads_per_stage, usable_cpus
from stack import Stack
from waiting import caught_up, until


@pytest.fixture(scope="module")
def epd(tiny_dir, tmp_path_factory):
    yield from serving(Stack(tmp_path_factory.mktemp("epd"), tiny_dir, encoders=1, generators=3))


@pytest.fixture(scope="module")
def aggregated(tiny_dir, tmp_path_factory):
    yield from serving(Stack(tmp_path_factory.mktemp("agg"), tiny_dir, encoders=0, generators=2, aggregated=True))


def epd_generate(tiny_dir, tmp_path, images, text, max_tokens=16):
    args = []
    for i, b in enumerate(images):
        path = tmp_path / f"img{i}.png"
        path.write_bytes(b)
        args += ["--image", str(path)]
    run = subprocess.run([sys.executable, str(REPO / "bin" / "epd-generate"), "--model", str(tiny_dir),
                          "--prompt", text, *args, "--max-tokens", str(max_tokens), "--json"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.splitlines()[-1])



@pytest.mark.parametrize("num_images", [0, 1, 2])
def test_chat_equals_offline_generation_and_aggregated_mode(epd, aggregated, tiny_dir, tmp_path, num_images):
    text = f"Describe these {num_images} pictures."
    expected = epd_generate(tiny_dir, tmp_path, IMAGES[num_images], text)
    for stream in (False, True):
        got, reason, usage = chat(epd, IMAGES[num_images], text, stream=stream)
        assert got == expected["text"]
        assert usage.prompt_tokens == len(expected["prompt_token_ids"])
        assert usage.completion_tokens == len(expected["token_ids"])
        assert reason in ("stop", "length")
        assert chat(aggregated, IMAGES[num_images], text, stream=stream)[0] == expected["text"]


def test_completions_models_and_health(epd):
    c = client(epd)
    assert [m.id for m in c.models.list().data] == ["tiny"]
    r = c.completions.create(model="tiny", prompt="Once upon a time", max_tokens=5, temperature=0)
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    assert httpx.get(epd.base_url + "/health").status_code == 200
    # SageMaker's /invocations serves either API by its body (vllm serve has it too).
    body = {"model": "tiny", "max_tokens": 5, "temperature": 0}
    text = httpx.post(epd.base_url + "/invocations", json={**body, "prompt": "Once upon a time"}, timeout=60).json()
    assert text["object"] == "text_completion" and text["choices"][0]["text"] == r.choices[0].text
    chat = httpx.post(epd.base_url + "/invocations", json={**body, "messages": chat_messages([], "hi")}, timeout=60)
    assert chat.json()["object"] == "chat.completion"


def test_model_stages_split_the_cores_among_them(epd):
    """Each of the 4 model stages runs torch on its share of the cores, not
    on all of them: 8 spinning threads on CI's 2 cores made 3-sequence
    decode steps take 350 ms, and a 300-token test time out."""
    share = threads_per_stage(4, usable_cpus())
    counts = re.findall(r"ready on \S+ \(.*, (\d+) CPU threads\)", epd.logs())
    assert len(counts) >= 4 and set(counts) == {str(share)}, counts


def test_64_concurrent_mixed_requests_succeed(epd):
    def one(i):
        images = IMAGES[i % 3] if i % 4 else [image_bytes(random_image(64, 64 + i, seed=1000 + i))]
        return chat(epd, images, f"request {i}", stream=bool(i % 2), max_tokens=8, ignore_eos=True)

    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(one, range(64)))
    assert all(usage.completion_tokens == 8 and reason == "length" for _, reason, usage in results)


def test_ten_concurrent_copies_of_a_new_image_are_encoded_once(epd):
    image = image_bytes(random_image(100, 100, seed=4242))
    caught_up(epd)  # the earlier tests' encodes are counted before `before`
    before = epd.total("epd_encoder_jobs_total", outcome="encoded")
    before_dedup = epd.total("epd_encoder_jobs_total", outcome="dedup")
    with ThreadPoolExecutor(10) as pool:
        results = list(pool.map(lambda i: chat(epd, [image], f"same image {i}", max_tokens=4), range(10)))
    assert [usage.completion_tokens for _, _, usage in results] == [4] * 10
    # Stats are polled, and a request may end (its embedding already cached at its generator) before the
    # encoder has read its job: wait until the encoder's counts show all ten jobs.
    until(lambda: (epd.total("epd_encoder_jobs_total", outcome="encoded") - before
                   + epd.total("epd_encoder_jobs_total", outcome="dedup") - before_dedup) >= 10,
          "the encoder's counts to show the ten jobs", deadline_s=10)
    assert epd.total("epd_encoder_jobs_total", outcome="encoded") - before == 1
    assert epd.total("epd_encoder_jobs_total", outcome="dedup") - before_dedup == 9


def test_metrics_show_where_stage_time_goes(epd):
    """The step and encoder totals behind /metrics move with the work: one
    new image and 6 tokens add a vision forward, an image decode, and
    decode steps with their time."""
    names = {"steps": ("epd_generator_steps_total", "kind", "decode"),
             "step_seconds": ("epd_generator_step_seconds_total", "kind", "decode"),
             "forwards": ("epd_encoder_images_total", "phase", "forward"),
             "decodes": ("epd_encoder_images_total", "phase", "decode"),
             "forward_seconds": ("epd_encoder_busy_seconds_total", "phase", "forward")}

    def read() -> dict[str, float]:
        return {k: epd.total(name, **{label: value}) for k, (name, label, value) in names.items()}

    def shown() -> dict[str, float] | None:
        """The totals once the polled stats show the request's image and its decode steps."""
        now = read()
        moved = now["forwards"] > before["forwards"] and now["decodes"] > before["decodes"]
        return now if moved and now["steps"] - before["steps"] >= 5 else None

    caught_up(epd)   # stats are polled: `before` has the earlier tests' work
    before = read()
    chat(epd, [image_bytes(random_image(72, 96, seed=5151))], "where does time go", max_tokens=6, ignore_eos=True)
    after = until(shown, "the stats to show the request's work", deadline_s=10)
    assert after["forwards"] - before["forwards"] == 1 and after["decodes"] - before["decodes"] == 1
    # 6 tokens: the first from the prefill, 5 decode steps. The prompt's start
    # is cached (prefix caching): where one token of it is left before the
    # image, whose embedding comes later, that one-token chunk is counted as
    # a decode step too (the profile's kinds go by tokens per request).
    assert after["steps"] - before["steps"] in (5, 6)
    assert after["step_seconds"] > before["step_seconds"] and after["forward_seconds"] > before["forward_seconds"]


def test_client_aborts_leave_nothing_held(epd):
    def abandon(i):
        try:
            with httpx.stream("POST", epd.base_url + "/v1/chat/completions", timeout=30, json={
                    "model": "tiny", "messages": chat_messages(IMAGES[1], f"long {i}"), "max_tokens": 7000,
                    "stream": True, "ignore_eos": True}) as r:
                for n, _ in enumerate(r.iter_lines()):
                    if n > 3:
                        return  # hang up mid-stream
        except httpx.HTTPError:
            pass

    aborted = epd.total("epd_requests_total", status="aborted")
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(abandon, range(8)))
    # The proxy counts an abort once it has noticed the hang-up and told the generator.
    until(lambda: epd.total("epd_requests_total", status="aborted") - aborted >= 8, "the proxy to abort all eight")
    caught_up(epd)   # a stats poll since the requests ran: the zeros below are not from before them
    held = ("epd_kv_blocks_used", "epd_arena_leases", "epd_running_requests")
    until(lambda: not any(epd.total(name) for name in held), "the aborted requests' blocks, leases and slots back")
    # Freed because the clients hung up, not because 7000 tokens were done.
    assert epd.total("epd_requests_total", status="aborted") - aborted == 8


@pytest.mark.parametrize("body,status,fragment", [
    (b"{not json", 400, "malformed JSON"),
    (json.dumps({"model": "tiny", "messages": []}).encode(), 400, "messages"),
    (json.dumps({"model": "tiny", "messages": chat_messages([b"garbage bytes"], "x")}).encode(), 400, "image 1"),
    # A valid header but truncated pixels: caught by the encoder, still the client's error.
    (json.dumps({"model": "tiny", "messages": chat_messages(
        [image_bytes(random_image(200, 200, seed=77), "JPEG")[:700]], "x")}).encode(), 400, "could not be encoded"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "ftp://example/x.png"}}]}]}).encode(), 400, "unsupported image URL"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "word " * 9000}]}).encode(), 400,
     "maximum context length"),
    (json.dumps({"model": "tiny", "messages": chat_messages(IMAGES[1] * 17, "x")}).encode(), 400, "too many images"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": -1}).encode(), 400,
     "temperature"),
])
def test_bad_input_gets_a_clear_4xx_and_harms_no_one(epd, body, status, fragment):
    r = httpx.post(epd.base_url + "/v1/chat/completions", content=body,
                   headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text
    assert fragment in r.json()["error"]["message"]
    assert chat(epd, IMAGES[1], "still fine?", max_tokens=4)[2].completion_tokens == 4


def test_stop_token_ids_end_the_answer_at_that_token(epd, tiny_dir, tmp_path):
    text = "Count for me."
    expected = epd_generate(tiny_dir, tmp_path, [], text, max_tokens=12)
    ids = expected["token_ids"]
    # The first token not seen before it: the answer must end just there.
    cut = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])
    got, reason, usage = chat(epd, [], text, max_tokens=12, stop_token_ids=[ids[cut]])
    assert reason == "stop" and usage.completion_tokens == cut + 1
    # As vLLM: the stop token's own text is left out of the answer.
    assert got == epd_generate(tiny_dir, tmp_path, [], text, max_tokens=cut)["text"]
    # And stop_reason names it, whole and streamed; a length limit leaves it null.
    body = {"model": "tiny", "messages": chat_messages([], text), "max_tokens": 12, "temperature": 0,
            "stop_token_ids": [ids[cut]]}
    whole = httpx.post(epd.base_url + "/v1/chat/completions", json=body, timeout=60).json()
    assert whole["choices"][0]["stop_reason"] == ids[cut]
    with httpx.stream("POST", epd.base_url + "/v1/chat/completions", timeout=60, json={**body, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert [(c["choices"][0]["finish_reason"], c["choices"][0]["stop_reason"]) for c in chunks if c["choices"]][-1] \
        == ("stop", ids[cut])
    short = httpx.post(epd.base_url + "/v1/chat/completions", json={**body, "max_tokens": 1, "stop_token_ids": []},
                       timeout=60).json()
    assert short["choices"][0]["finish_reason"] == "length" and short["choices"][0]["stop_reason"] is None
    # vLLM's include_stop_str_in_output keeps the stop token's text.
    kept, reason, _ = chat(epd, [], text, max_tokens=12, stop_token_ids=[ids[cut]], include_stop_str_in_output=True)
    assert reason == "stop" and kept == epd_generate(tiny_dir, tmp_path, [], text, max_tokens=cut + 1)["text"]


def test_allowed_token_ids_reach_the_engine_through_the_stack(epd):
    words = httpx.post(epd.base_url + "/tokenize", json={"model": "tiny", "prompt": "cat sky tree"},
                       timeout=10).json()["tokens"]
    names = {httpx.post(epd.base_url + "/detokenize", json={"model": "tiny", "tokens": [t]}, timeout=10)
             .json()["prompt"] for t in words}
    assert len(names) == len(words) > 1 and "\ufffd" not in "".join(names)   # tokens told apart by their text
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 6, "temperature": 0, "logprobs": 0,
            "allowed_token_ids": words, "ignore_eos": True}
    reply = httpx.post(epd.base_url + "/v1/completions", json=body, timeout=60).json()
    tokens = reply["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == 6 and set(tokens) <= names, (tokens, names)
    # bad_words reaches the engine too: the free answer's first word, banned, does not come first.
    free = {**body, "allowed_token_ids": None}
    first = httpx.post(epd.base_url + "/v1/completions", json=free, timeout=60).json()["choices"][0]["logprobs"]
    word = first["tokens"][0]
    ids = httpx.post(epd.base_url + "/tokenize", json={"prompt": word}, timeout=10).json()["tokens"]
    assert len(ids) == 1, "the first token's text is not one token: no bad word to test with"
    banned = httpx.post(epd.base_url + "/v1/completions", json={**free, "bad_words": [word]}, timeout=60).json()
    assert banned["choices"][0]["logprobs"]["tokens"][0] != word


def test_a_client_that_hangs_up_is_aborted_within_100_ms(epd):
    aborted = epd.total("epd_requests_total", status="aborted")
    with httpx.stream("POST", epd.base_url + "/v1/chat/completions", timeout=30, json={
            "model": "tiny", "messages": chat_messages([], "go on"), "max_tokens": 7000, "stream": True,
            "ignore_eos": True}) as r:
        for n, _ in enumerate(r.iter_lines()):
            if n > 3:
                break
        hung_up = time.monotonic()
    # The proxy's own counter moves when it has aborted the request in its generator.
    until(lambda: epd.total("epd_requests_total", status="aborted") > aborted, "the proxy to abort the request",
          deadline_s=5, interval_s=0.005)
    assert time.monotonic() - hung_up < 0.1
    caught_up(epd)   # a stats poll since the request ran: a 0 below is not from before it
    until(lambda: epd.total("epd_running_requests") == 0, "the generator to end the aborted request", deadline_s=10)


def test_vllm_named_series_are_served(epd):
    """vLLM's names, types and labels, parsed by prometheus-client's own
    parser, with plausible values during and after real requests."""
    from prometheus_client.parser import text_string_to_metric_families

    def families():
        text = httpx.get(epd.base_url + "/metrics", timeout=10).text
        return {f.name: f for f in text_string_to_metric_families(text) if f.name.startswith("vllm:")}

    chat(epd, IMAGES[1], "count the tokens", max_tokens=6)
    chat(epd, IMAGES[1], "once more", max_tokens=6)   # the same image: a multimodal cache hit
    # Long enough to span several of the proxy's stats polls (every 0.5 s):
    # the tiny model decodes 400 tokens in less than one poll interval.
    long_tokens = 3000
    with httpx.stream("POST", epd.base_url + "/v1/chat/completions", timeout=120, json={
            "model": "tiny", "messages": chat_messages([], "keep going"), "max_tokens": long_tokens,
            "stream": True, "ignore_eos": True}) as r:
        lines = r.iter_lines()
        next(lines)
        usage = until(lambda: max(s.value for s in families()["vllm:kv_cache_usage_perc"].samples),
                      "a KV cache usage above 0 while the long request runs", deadline_s=30, interval_s=0.1)
        for _ in lines:
            pass
    assert 0 < usage <= 1
    found = families()
    kinds = {"vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
             "vllm:kv_cache_usage_perc": "gauge", "vllm:num_preemptions": "counter",
             "vllm:prompt_tokens": "counter", "vllm:generation_tokens": "counter",
             "vllm:request_success": "counter", "vllm:time_to_first_token_seconds": "histogram",
             "vllm:time_per_output_token_seconds": "histogram", "vllm:e2e_request_latency_seconds": "histogram",
             "vllm:request_queue_time_seconds": "histogram", "vllm:request_prefill_time_seconds": "histogram",
             "vllm:request_decode_time_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
             "vllm:request_time_per_output_token_seconds": "histogram", "vllm:request_prompt_tokens": "histogram",
             "vllm:request_generation_tokens": "histogram", "vllm:request_inference_time_seconds": "histogram",
             "vllm:request_params_max_tokens": "histogram", "vllm:mm_cache_queries": "counter",
             "vllm:mm_cache_hits": "counter"}
    for name, kind in kinds.items():
        assert found[name].type == kind, name
        assert all(s.labels.get("model_name") == "tiny" for s in found[name].samples), name
    engines = {s.labels["engine"] for s in found["vllm:num_requests_running"].samples}
    assert engines == {"0", "1", "2"}    # one per generator
    total = lambda name, **labels: sum(s.value for s in found[name].samples  # noqa: E731
                                       if s.name == name + "_total" and all(s.labels.get(k) == v
                                                                            for k, v in labels.items()))
    assert total("vllm:generation_tokens") >= long_tokens + 6 and total("vllm:prompt_tokens") > 0
    assert total("vllm:request_success", finished_reason="length") >= 2
    counts = [s.value for s in found["vllm:e2e_request_latency_seconds"].samples if s.name.endswith("_count")]
    assert counts and counts[0] >= 2

    def histogram(name):
        samples = found[name].samples
        count = next(s.value for s in samples if s.name == name + "_count")
        return count, next(s.value for s in samples if s.name == name + "_sum")

    for phase in ("queue", "prefill", "decode"):
        count, seconds = histogram(f"vllm:request_{phase}_time_seconds")
        assert count == counts[0] and seconds > 0, phase     # every finished request, once
    count, seconds = histogram("vllm:request_inference_time_seconds")   # prefill and decode, per request
    phases = [histogram(f"vllm:request_{phase}_time_seconds")[1] for phase in ("prefill", "decode")]
    assert count == counts[0] and seconds == pytest.approx(sum(phases))
    count, asked = histogram("vllm:request_params_max_tokens")
    assert count == counts[0] and asked >= long_tokens + 12
    assert total("vllm:mm_cache_queries") >= 2 and 1 <= total("vllm:mm_cache_hits") < total("vllm:mm_cache_queries")
    assert {s.labels["engine"] for s in found["vllm:mm_cache_hits"].samples} == set(epd.encoder_instances)
    e2e_seconds = histogram("vllm:e2e_request_latency_seconds")[1]
    assert 0 < histogram("vllm:request_decode_time_seconds")[1] < e2e_seconds   # the long one decoded a while
    count, seconds = histogram("vllm:inter_token_latency_seconds")
    assert count >= long_tokens - 1 and 0 < seconds < e2e_seconds         # every interval after a first token
    assert histogram("vllm:time_per_output_token_seconds") == (count, seconds)   # vLLM's older name for it
    # Per request, as vLLM: each one's mean interval once, and its token counts.
    means, mean_seconds = histogram("vllm:request_time_per_output_token_seconds")
    assert 2 <= means <= counts[0] and 0 < mean_seconds < seconds
    assert histogram("vllm:request_prompt_tokens") == (counts[0], total("vllm:prompt_tokens"))
    generated = histogram("vllm:request_generation_tokens")
    assert generated[0] == counts[0] and long_tokens <= generated[1] <= total("vllm:generation_tokens")
    buckets = [s.labels["le"] for s in found["vllm:request_prompt_tokens"].samples if s.name.endswith("_bucket")]
    assert buckets[:4] == ["1.0", "2.0", "5.0", "10.0"] and buckets[-1] == "+Inf"   # vLLM's 1-2-5 to the context

    # Once per request, not per choice: n, and its longest choice's tokens.
    assert found["vllm:request_params_n"].type == found["vllm:request_max_num_generation_tokens"].type == "histogram"
    n_before, most_before = histogram("vllm:request_params_n"), histogram("vllm:request_max_num_generation_tokens")
    assert n_before[0] == most_before[0] and most_before[1] >= long_tokens
    two = httpx.post(epd.base_url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": chat_messages([], "two of them"), "n": 2, "max_tokens": 5, "ignore_eos": True})
    assert two.status_code == 200 and len(two.json()["choices"]) == 2
    found = families()
    assert histogram("vllm:request_params_n") == (n_before[0] + 1, n_before[1] + 2)
    assert histogram("vllm:request_max_num_generation_tokens") == (most_before[0] + 1, most_before[1] + 5)

    # Per engine: tokens per step (their sum is the steps' tokens), and the KV cache's configuration.
    def scrape():
        return {f.name: f for f in text_string_to_metric_families(httpx.get(epd.base_url + "/metrics").text)}

    def when_caught_up():   # the stages' stats are polled: wait for a scrape that has the long request's steps
        found = scrape()
        return found if sum(s.value for s in found["epd_generator_step_tokens"].samples) >= long_tokens else None

    everything = until(when_caught_up, "the steps' tokens of the long request in the stats", deadline_s=15)
    steps = everything["vllm:iteration_tokens_total"]
    assert steps.type == "histogram" and {s.labels["engine"] for s in steps.samples} == {"0", "1", "2"}
    step_sum = sum(s.value for s in steps.samples if s.name.endswith("_sum"))
    step_tokens = sum(s.value for s in everything["epd_generator_step_tokens"].samples)
    assert step_sum == step_tokens >= long_tokens
    step_count = sum(s.value for s in steps.samples if s.name.endswith("_count"))
    decode_steps = sum(s.value for s in everything["epd_generator_steps"].samples
                       if s.labels["kind"] in ("decode", "mixed"))
    assert step_count == decode_steps > 0
    kv_totals = {s.labels["instance"]: s.value for s in everything["epd_kv_blocks_total"].samples}
    config = everything["vllm:cache_config_info"].samples
    assert len(config) == 3 and all(s.value == 1 and s.labels["block_size"] == "16" for s in config)
    assert sorted(int(s.labels["num_gpu_blocks"]) for s in config) == sorted(map(int, kv_totals.values()))
    assert {s.labels["enable_prefix_caching"] for s in config} == {"True"}

    # The dashboard in the repository names only series this server has.
    text = httpx.get(epd.base_url + "/metrics", timeout=10).text
    served = {f.name for f in text_string_to_metric_families(text)}
    dashboard = json.loads((REPO / "docs" / "grafana" / "epd-dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    named = {re.sub(r"_(bucket|total|count|sum)$", "", n) for e in exprs for n in re.findall(r"(?:vllm:|epd_)\w+", e)}
    assert len(named) >= 20 and named <= served, named - served


def test_a_truncated_image_prompt_is_served_alike_in_both_layouts(epd, aggregated):
    """truncate_prompt_tokens that cuts the start of the system turn and keeps
    the image: both layouts answer the shorter prompt alike, token for
    token; one that would cut into the image is a 400."""
    messages = chat_messages(IMAGES[1], "Describe it at length, please, in many words.")
    counted = httpx.post(epd.base_url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": messages, "max_tokens": 1}).json()["usage"]["prompt_tokens"]
    body = {"model": "tiny", "messages": messages, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "logprobs": True, "truncate_prompt_tokens": counted - 8}
    answers = []
    for stack in (epd, aggregated):
        reply = httpx.post(stack.base_url + "/v1/chat/completions", timeout=60, json=body).json()
        assert reply["usage"]["prompt_tokens"] == counted - 8, reply
        answers.append([e["token"] for e in reply["choices"][0]["logprobs"]["content"]])
    assert answers[0] == answers[1] and len(answers[0]) == 6
    cut = httpx.post(epd.base_url + "/v1/chat/completions", timeout=60, json={**body, "truncate_prompt_tokens": 10})
    assert cut.status_code == 400 and "would cut" in cut.json()["error"]["message"]


def test_continuous_usage_stats_count_every_chunk(epd):
    """vLLM's stream_options.continuous_usage_stats: each chunk with tokens
    carries the counts so far, per choice; the last usage chunk the totals."""
    for route, body in (("/v1/chat/completions", {"messages": chat_messages([], "Count.")}),
                        ("/v1/completions", {"prompt": "One two", "n": 2})):
        body = {"model": "tiny", "max_tokens": 5, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}, **body}
        with httpx.stream("POST", epd.base_url + route, timeout=60, json=body) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        final = chunks[-1]
        assert final["choices"] == [] and final["usage"]["completion_tokens"] == 5 * body.get("n", 1)
        for index in range(body.get("n", 1)):
            counted = [c["usage"] for c in chunks if c["choices"] and c["choices"][0]["index"] == index
                       and "usage" in c]
            assert [u["completion_tokens"] for u in counted][-1] == 5
            assert counted == sorted(counted, key=lambda u: u["completion_tokens"])
            assert {u["prompt_tokens"] for u in counted} == {final["usage"]["prompt_tokens"]}
            assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in counted)
