"""epd-bench: exact metrics on hand-made records, timing against a synthetic
SSE server with known sleeps, the arrival process, and CLI input errors.
(tests/bench_fakes.py holds the synthetic server.)"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from bench_fakes import NUM_CHUNKS, endpoint_thread, small_dataset, sweep_against_fake
from pipeline.bench.client import ProtocolError, _read_stream
from pipeline.bench.dataset import (POOL_SIZE_PER_BUCKET, arrival_offsets, arrivals_within, parse_bucket_config,
                                    sample_requests)
from pipeline.bench.metrics import RequestRecord, parse_goodput, records_from_detailed, summarize
from pipeline.bench.window import WindowSpec, sustained_summary

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bin" / "epd-bench"


# ---- metrics on hand-made records -------------------------------------------------

def test_metrics_exact_on_hand_made_records():
    records = [
        RequestRecord(True, prompt_tokens=10, completion_tokens=5, ttft=0.1, itl=[0.01, 0.02, 0.03], e2el=0.3),
        RequestRecord(True, prompt_tokens=20, completion_tokens=3, ttft=0.3, itl=[0.05], e2el=0.5),
        RequestRecord(True, prompt_tokens=30, completion_tokens=1, ttft=0.2, itl=[], e2el=0.2),
        RequestRecord(False, error="HTTP 500: boom"),
    ]
    result = summarize(records, duration=2.0, slos={"ttft": 250, "tpot": 60})
    assert result["completed"] == 3 and result["failed"] == 1
    assert result["errors"] == ["HTTP 500: boom"]
    assert result["total_input_tokens"] == 60 and result["total_output_tokens"] == 9
    assert result["request_throughput"] == pytest.approx(1.5)
    assert result["output_throughput"] == pytest.approx(4.5)
    assert result["mean_ttft_ms"] == pytest.approx(200.0)
    assert result["median_ttft_ms"] == pytest.approx(200.0)
    assert result["p90_ttft_ms"] == pytest.approx(280.0)  # linear interpolation 200..300
    # TPOT: (0.3-0.1)/4 = 50 ms and (0.5-0.3)/2 = 100 ms; one-token request has none.
    assert result["mean_tpot_ms"] == pytest.approx(75.0)
    assert result["p99_tpot_ms"] == pytest.approx(99.5)
    assert result["mean_itl_ms"] == pytest.approx(27.5)
    assert result["median_itl_ms"] == pytest.approx(25.0)
    assert result["mean_e2el_ms"] == pytest.approx(1000 / 3)
    # Good: first (ttft 100, tpot 50) and third (ttft 200, no tpot); second fails ttft.
    assert result["request_goodput"] == pytest.approx(1.0)


def test_metrics_empty_samples_are_none_and_goodput_needs_slos():
    result = summarize([RequestRecord(False, error="x")], duration=1.0)
    assert result["completed"] == 0 and result["failed"] == 1
    assert result["mean_ttft_ms"] is None and result["p99_itl_ms"] is None
    assert result["request_goodput"] is None


def test_parse_goodput():
    assert parse_goodput(["ttft:200", "e2el:1500.5"]) == {"ttft": 200.0, "e2el": 1500.5}
    for bad in (["ttft"], ["foo:1"], ["tpot:abc"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


# ---- against a synthetic SSE server ------------------------------------------------

def test_client_timing_against_synthetic_stream():
    results, seen = asyncio.run(sweep_against_fake(small_dataset(), [float("inf")], {"ttft": 1000, "tpot": 500}))
    (r,) = results
    assert r["model_id"] == "fake-model" and r["request_rate"] == "inf" and r["max_concurrency"] == 4
    assert r["completed"] == 8 and r["failed"] == 0
    assert r["total_output_tokens"] == 8 * NUM_CHUNKS and r["total_input_tokens"] == 8 * 7
    assert 50 <= r["mean_ttft_ms"] < 90
    assert 9.5 <= r["mean_tpot_ms"] < 16
    assert 9 <= r["median_itl_ms"] < 16
    assert 100 <= r["mean_e2el_ms"] < 160
    assert round(r["request_goodput"] * r["duration"]) == 8
    # A burst has no arrival rate; its window SLO figures cover every request.
    assert r["offered_rate"] is None and r["sustained"] is None and r["cancelled"] == 0
    assert r["window_requests"] == 8 and 50 <= r["window_p99_ttft_ms"] < 120
    body = seen[0]
    assert body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["temperature"] == 0 and body["max_tokens"] == 6
    url = body["messages"][0]["content"][1]["image_url"]["url"]
    image = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
    assert image.format == "JPEG" and image.size == (48, 32)


class _Lines:
    """A response whose body is the given SSE lines."""

    def __init__(self, *chunks):
        self.content = self._lines([f"data: {json.dumps(c)}\n".encode() for c in chunks] + [b"data: [DONE]\n"])

    @staticmethod
    async def _lines(lines):
        for line in lines:
            yield line


def _choice_chunk(delta, finish_reason=None):
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}


def test_an_answer_of_only_special_tokens_is_a_success_and_a_stream_without_an_end_is_not():
    usage = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 16}}
    empty = _Lines(_choice_chunk({"role": "assistant", "content": ""}), _choice_chunk({}, "length"), usage)
    record = RequestRecord(success=False)
    asyncio.run(_read_stream(empty, record, time.perf_counter()))
    assert record.success and record.completion_tokens == 16 and record.itl == []
    assert 0 < record.ttft <= record.e2el
    cut = _Lines(_choice_chunk({"role": "assistant", "content": ""}), usage)
    with pytest.raises(ProtocolError, match="without any content"):
        asyncio.run(_read_stream(cut, RequestRecord(success=False), time.perf_counter()))


def test_goodput_failures_and_sweep():
    dataset = small_dataset(num_prompts=8)
    results, seen = asyncio.run(sweep_against_fake(dataset, [200.0, 400.0], {"ttft": 5}, fail_every=4))
    assert [r["request_rate"] for r in results] == [200.0, 400.0]
    assert len(seen) == 16
    for r in results:
        assert r["completed"] == 6 and r["failed"] == 2
        assert all(err.startswith("HTTP 500") for err in r["errors"])
        assert r["request_goodput"] == 0.0  # TTFT ~50 ms never meets a 5 ms SLO
    # Different seeds per rate: the second run does not replay the first's prompts.
    assert seen[0]["messages"] != seen[8]["messages"]


def test_text_only_fraction_mixes_the_load_and_splits_the_results():
    dataset = small_dataset(num_prompts=20, text_only_fraction=0.5)
    (r,), seen = asyncio.run(sweep_against_fake(dataset, [float("inf")], {"tpot": 500}))
    images = [sum(part["type"] == "image_url" for part in body["messages"][0]["content"]) for body in seen]
    text_only = images.count(0)
    assert 0 < text_only < 20 and set(images) == {0, 1}
    classes = r["by_class"]
    assert classes["text_only"]["completed"] == text_only
    assert classes["with_images"]["completed"] == 20 - text_only
    assert 9.5 <= classes["text_only"]["p99_tpot_ms"] < 20 and classes["with_images"]["median_ttft_ms"] >= 50
    assert r["window_by_class"] == classes   # no warm-up: the window holds every request
    # Without the option, nothing changes: no class split, every request has its image.
    (plain,), seen = asyncio.run(sweep_against_fake(small_dataset(num_prompts=4), [float("inf")], {}))
    assert "by_class" not in plain and all(len(b["messages"][0]["content"]) == 2 for b in seen)
    with pytest.raises(ValueError, match="text-only-fraction"):
        small_dataset(text_only_fraction=1.5)


def test_a_random_prefix_starts_every_prompt_and_leaves_the_rest_as_it_was():
    plain = sample_requests(small_dataset(num_prompts=6, text_only_fraction=0.5), np.random.default_rng(3))
    shared = sample_requests(small_dataset(num_prompts=6, text_only_fraction=0.5, prefix_len=30),
                             np.random.default_rng(3))
    prefix = shared[0].prompt.split()[:30]
    assert len(prefix) == 30 and all(r.prompt.split()[:30] == prefix for r in shared)
    assert [r.prompt_len for r in shared] == [r.prompt_len + 30 for r in plain]
    assert [r.prompt.split()[30:] for r in shared] == [r.prompt.split() for r in plain]   # the rest as it was
    assert [r.images for r in shared] == [r.images for r in plain]
    other_seed = sample_requests(small_dataset(num_prompts=2, prefix_len=30), np.random.default_rng(4))
    assert other_seed[0].prompt.split()[:30] == prefix   # a system prompt every run shares
    with pytest.raises(ValueError, match="random-prefix-len"):
        small_dataset(prefix_len=-1)


# ---- workload and arrivals -----------------------------------------------------------

def test_poisson_and_gamma_arrivals():
    rng = np.random.default_rng(0)
    gaps = np.diff(arrival_offsets(20001, 5.0, 1.0, rng))
    assert gaps.mean() == pytest.approx(0.2, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV = 1
    bursty = np.diff(arrival_offsets(20001, 5.0, 0.25, rng))
    assert bursty.mean() == pytest.approx(0.2, rel=0.05)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.05)  # gamma: CV = 1/sqrt(shape)
    assert not arrival_offsets(5, float("inf"), 1.0, rng).any()
    first = arrival_offsets(10, 3.0, 1.0, np.random.default_rng(7))
    assert np.array_equal(first, arrival_offsets(10, 3.0, 1.0, np.random.default_rng(7)))


def test_a_span_of_arrivals_fills_its_span_at_its_rate():
    # A fixed count of Poisson arrivals at 1.7 req/s ends seconds early or
    # late; the arrivals of a span start at 0 and end at its end, at any seed.
    for seed in range(200):
        offsets = arrivals_within(40.0, 1.7, 1.0, np.random.default_rng(seed), least=10)
        assert offsets[0] == 0.0 and np.all(np.diff(offsets) >= 0) and offsets[-1] == pytest.approx(40.0)
        assert offsets[-1] <= 40.0 and len(offsets) == 68
    fixed = [arrival_offsets(68, 1.7, 1.0, np.random.default_rng(seed))[-1] for seed in range(200)]
    assert min(fixed) < 32.0 and max(fixed) > 48.0  # what the span rule is for
    # The bounds: a slow rate still sends `least`; `most` caps; a bursty span keeps its burstiness.
    assert len(arrivals_within(1.0, 0.5, 1.0, np.random.default_rng(1), least=10)) == 10
    assert len(arrivals_within(40.0, 100.0, 1.0, np.random.default_rng(1), least=10, most=25)) == 25
    bursty = arrivals_within(10.0, 50.0, 0.05, np.random.default_rng(3), least=1)
    assert len(bursty) == 500 and bursty[-1] <= 10.0 and np.all(np.diff(bursty) >= 0)
    assert np.diff(bursty).std() / np.diff(bursty).mean() > 3   # gamma(0.05): CV about 4.5
    with pytest.raises(ValueError, match="span"):
        arrivals_within(10.0, float("inf"), 1.0, np.random.default_rng(1), least=1)
    with pytest.raises(ValueError, match="burstiness"):
        arrivals_within(10.0, 1.0, 0.0, np.random.default_rng(1), least=1)


def test_a_search_step_offers_its_rate_in_its_window_at_every_seed():
    """The window after the warm-up offers the step's rate to within rounding
    (window.py's offered rate: arrivals in [W, A] / (A - W)); Poisson counts
    offered 0.95-1.13x at the default seed's first three steps."""
    poisson, paced = [], []
    for seed in range(50):
        for rate in (1.7, 16.71):
            offsets = arrivals_within(40.0, rate, 1.0, np.random.default_rng(seed), least=10, warmup_s=10.0)
            window = WindowSpec(warmup_s=10.0)
            records = [RequestRecord(True, sent_at=t, done_at=t + 1.0) for t in offsets]
            paced.append(sustained_summary(records, window)["offered_rate"] / rate)
            warm = offsets[offsets < 10.0]
            assert len(warm) == round(10.0 * rate) and warm[0] == 0.0   # the warm-up holds its share too
            drawn = arrival_offsets(int(rate * 60), rate, 1.0, np.random.default_rng(seed))
            drawn = drawn[drawn < 40.0]
            poisson.append(((drawn >= 10.0).sum() / (drawn[-1] - 10.0)) / rate)
    assert max(abs(r - 1) for r in paced) < 0.02
    assert max(abs(r - 1) for r in poisson) > 0.1     # what pacing is for


def test_request_lengths_image_counts_and_reuse():
    cfg = small_dataset(num_prompts=200, output_len=10, range_ratio=0.5, base_items=2,
                        items_range_ratio=0.5, image_reuse=1.0,
                        buckets=parse_bucket_config("{(8, 8, 1): 1, (16, 8, 1): 3}"))
    requests = sample_requests(cfg, np.random.default_rng(1))
    assert {len(r.prompt.split()) == r.prompt_len for r in requests} == {True}
    assert {r.prompt_len for r in requests} <= set(range(10, 31))
    assert {r.output_len for r in requests} <= set(range(5, 16))
    assert {len(r.image_urls) for r in requests} == {1, 2, 3}
    urls = {u for r in requests for u in r.image_urls}
    assert len(urls) <= 2 * POOL_SIZE_PER_BUCKET


def test_bucket_config_normalized():
    assert parse_bucket_config("{(4, 4, 1): 1, (8, 8, 1): 3}") == {(4, 4, 1): 0.25, (8, 8, 1): 0.75}
    assert parse_bucket_config("{(4, 4, 16): 1}") == {(4, 4, 16): 1.0}   # a clip of 16 frames
    for bad in ("{(4, 4): 1}", "{(4, 4, 0): 1}", "[1]", "{(4, 4, 1): -1}", "{(4, 4, 1): 0}"):
        with pytest.raises(ValueError):
            parse_bucket_config(bad)


# ---- CLI --------------------------------------------------------------------------------

def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("args, fragment", [
    (["--random-mm-bucket-config", "{(64, 64, 1): 0.5"], "--random-mm-bucket-config"),
    (["--goodput", "latency:5"], "--goodput"),
    (["--request-rate", "2,fast"], "--request-rate"),
    (["--image-reuse", "1.5"], "--image-reuse"),
    (["--request-rate", "search:1"], "search:LOW:HIGH"),
    (["--request-rate", "search:8:2", "--goodput", "ttft:5"], "0 < LOW < HIGH"),
    (["--request-rate", "search:1:8"], "needs --goodput"),
    (["--request-rate", "search:1:8", "--goodput", "ttft:5", "--goodput-target", "1.5"], "--goodput-target"),
    (["--request-rate", "search:1:8", "--goodput", "ttft:5", "--search-step-s", "3"], "--warmup-s (4)"),
    (["--request-rate", "search:1:8", "--goodput", "ttft:5", "--sustained-fraction", "1.5"],
     "--sustained-fraction"),
    (["--request-rate", "search:1:8", "--goodput", "ttft:5", "--drain-timeout-s", "0"], "--drain-timeout-s"),
    (["--request-rate", "4", "--warmup-s", "-1"], "--warmup-s"),
])
def test_cli_bad_input_exits_2_with_one_line(args, fragment):
    proc = run_cli("--base-url", "http://127.0.0.1:9", *args)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("epd-bench: error:") and fragment in lines[0]


def test_cli_unreachable_server_exits_1():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the with-block ends: connection refused
    proc = run_cli("--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "1")
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert "GET" in proc.stderr and "/v1/models" in proc.stderr


@pytest.fixture
def fake_endpoint():
    with endpoint_thread() as endpoint:
        yield endpoint


@pytest.fixture
def serial_endpoint():
    """One request at a time: about 10 req/s of capacity."""
    with endpoint_thread(serial=True) as endpoint:
        yield endpoint


SMALL_WORKLOAD = ("--random-input-len", "5", "--random-output-len", "4", "--random-mm-bucket-config",
                  "{(16, 16, 1): 1.0}")


def test_cli_end_to_end_writes_json(tmp_path, fake_endpoint):
    base_url, _ = fake_endpoint
    out = tmp_path / "r.json"
    proc = run_cli("--base-url", base_url, "--num-prompts", "3", "--request-rate", "50,100", *SMALL_WORKLOAD,
                   "--goodput", "e2el:10000", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    results = json.loads(out.read_text())
    assert [r["request_rate"] for r in results] == [50.0, 100.0]
    keys = {"completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
            "request_goodput", "output_throughput", "request_rate", "max_concurrency"}
    keys |= {f"{s}_{m}_ms" for s in ("mean", "median", "p90", "p99") for m in ("ttft", "tpot", "itl", "e2el")}
    keys |= {"offered_rate", "achieved_rate", "sustained_ratio", "window_s", "sustained", "cancelled"}
    for r in results:
        assert keys <= set(r) and r["completed"] == 3 and r["failed"] == 0 and r["cancelled"] == 0
        assert r["slo_attainment"] == 1.0 and r["window_s"]["start"] == 0.0 and r["offered_rate"] > 0
    assert "3/3 done" in proc.stderr


def test_save_detailed_lets_a_run_be_measured_again(tmp_path, fake_endpoint):
    # The saved columns rebuild the records, so the window measured from
    # them afterwards equals the one the run reported.
    base_url, _ = fake_endpoint
    out = tmp_path / "r.json"
    proc = run_cli("--base-url", base_url, "--num-prompts", "6", "--request-rate", "40", *SMALL_WORKLOAD,
                   "--warmup-s", "0.02", "--save-detailed", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    columns = result["requests"]
    assert len(columns["sent_at"]) == 6 and all(columns["success"]) and set(columns["errors"]) == {""}
    records = records_from_detailed(columns)
    assert [r.completion_tokens for r in records] == columns["output_lens"]
    again = sustained_summary(records, WindowSpec(0.02))
    assert again["offered_rate"] == pytest.approx(result["offered_rate"])
    assert again["achieved_rate"] == pytest.approx(result["achieved_rate"])


@pytest.mark.parametrize("ttft_slo, passes", [("1000", True), ("5", False)])
def test_cli_goodput_search_writes_steps_and_plot(tmp_path, fake_endpoint, ttft_slo, passes):
    # The synthetic server's TTFT is ~50 ms at any load: a 1 s SLO passes at
    # every rate (the answer sits at HIGH), a 5 ms SLO at none. Its capacity
    # is unbounded, so every step is sustained; a 0.5 fraction leaves room
    # for a request at either edge of a 10-request window to fall out.
    base_url, seen = fake_endpoint
    out, png = tmp_path / "search.json", tmp_path / "search.png"
    proc = run_cli("--base-url", base_url, "--request-rate", "search:20:80", "--search-steps", "3",
                   "--search-step-s", "0.15", "--warmup-s", "0", "--sustained-fraction", "0.5",
                   "--num-prompts", "12", *SMALL_WORKLOAD, "--goodput", f"ttft:{ttft_slo}", "--json", str(out),
                   "--plot", str(png), "--no-progress")
    assert proc.returncode == 0, proc.stderr
    found = json.loads(out.read_text())
    steps = found["steps"]
    assert [s["passed"] for s in steps] == [passes] * 3
    assert all(10 <= s["num_prompts"] <= 12 for s in steps)  # the arrivals in 0.15 s, at least 10, at most 12
    assert len(seen) == sum(s["num_prompts"] for s in steps)
    assert found["search"]["target"] == 0.9 and found["search"]["sustained_fraction"] == 0.5
    assert "partial" not in found
    for step in steps:
        assert step["sustained"] is True and step["cancelled"] == 0 and step["window_s"]["start"] == 0.0
        assert step["miss_reasons"] == ([] if passes else ["SLO attainment 0.000 < 0.9"])
    if passes:
        assert found["at_bound"] == "high" and found["max_request_rate"] == pytest.approx(20 * 4 ** (7 / 8))
        assert found["max_offered_rate"] == steps[-1]["offered_rate"] > 0
        assert found["max_achieved_rate"] == steps[-1]["achieved_rate"] > 0
    else:
        assert found["at_bound"] == "low" and found["max_request_rate"] is None
        assert found["max_offered_rate"] is None
    assert proc.stderr.count("epd-bench: step ") == 3
    assert proc.stderr.count("-> pass" if passes else "-> miss (SLO attainment 0.000 < 0.9)") == 3
    assert ("epd-bench: maximum rate meeting the SLOs: 67.3 req/s" if passes else
            "epd-bench: no step passed (the maximum lies below 20 req/s") in proc.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_search_step_that_falls_behind_misses(tmp_path, serial_endpoint):
    # 40 req/s to a ~10 req/s server: latencies stay far under the SLOs while
    # the queue grows, which only the sustained check catches.
    base_url, seen = serial_endpoint
    out = tmp_path / "search.json"
    proc = run_cli("--base-url", base_url, "--request-rate", "search:20:80", "--search-steps", "1",
                   "--search-step-s", "0.3", "--warmup-s", "0", "--search-criterion", "p99", *SMALL_WORKLOAD,
                   "--goodput", "ttft:100000", "tpot:100000", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    found = json.loads(out.read_text())
    (step,) = found["steps"]
    assert step["num_prompts"] >= 10 and len(seen) == step["num_prompts"] == step["completed"]
    assert not step["passed"] and step["sustained"] is False and step["sustained_ratio"] < 0.5
    assert step["miss_reasons"] == [f"fell behind: achieved {step['sustained_ratio']:.2f}x offered"]
    assert found["max_request_rate"] is None and found["at_bound"] == "low"
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("epd-bench: step 1:")]
    assert "offered " in line and "achieved " in line and "P99 TTFT " in line and "-> miss (fell behind" in line
