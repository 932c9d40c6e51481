"""The series vLLM's dashboards, alerts and routers read, with vLLM's names,
meanings, `model_name` label and bucket boundaries, for those this server
can report truthfully; beside our own epd_* series, from the same events.

Per request (the proxy sees each one end): prompt and generation tokens,
in all and per request; successes by finish reason; time to first token;
each request's mean time per output token after the first
(vllm:request_time_per_output_token_seconds); every interval between
tokens (vllm:inter_token_latency_seconds, and under vLLM's deprecated name
for the same, vllm:time_per_output_token_seconds); end-to-end latency; the
time its generator had it queued, in prefill and in decode (the request's
last delta carries them), and prefill and decode together (inference);
its max_tokens. Once per request (its last choice's end): its n, and the
most tokens any of its choices generated
(vllm:request_max_num_generation_tokens). One difference: the intervals are as the proxy receives
deltas (a delta of k tokens counts as k intervals of a k-th of its wait
each). Per generator (`engine` label, as vLLM reports per engine; from the
stages' stats): running and waiting requests, KV cache usage, preemptions,
prefix cache queries and hits, tokens per engine step (the tokens its
forward ran: prompt tokens, and one per decoding sequence;
vllm:iteration_tokens_total), and vllm:cache_config_info (block_size,
num_gpu_blocks, enable_prefix_caching). Per encoder (its instance as `engine`):
the multimodal cache's queries and hits, in items (an image or video whose
embedding the encoder already had, or was making, is a hit).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily


TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
# Our finish reasons as vLLM's label values.
FINISHED_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}


def buckets_1_2_5(largest: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `largest`: vLLM's token-count buckets."""
    out, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > largest:
                return tuple(out)
            out.append(step * scale)
        scale *= 10


class VllmSeries:
    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int = 1) -> None:
        self.model_name = model_name
        label = ["model_name"]
        tokens = buckets_1_2_5(max_model_len)
        self.request_prompt_tokens = Histogram("vllm:request_prompt_tokens", "Prompt tokens, per request", label,
                                               buckets=tokens, registry=registry)
        self.request_generation_tokens = Histogram("vllm:request_generation_tokens", "Generated tokens, per request",
                                                   label, buckets=tokens, registry=registry)
        self.request_tpot = Histogram("vllm:request_time_per_output_token_seconds",
                                      "Time per output token after the first, each request's mean", label,
                                      buckets=TPOT_BUCKETS, registry=registry)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens processed", label, registry=registry)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generation tokens processed", label,
                                         registry=registry)
        self.success = Counter("vllm:request_success", "Requests that finished, by finish reason",
                               ["model_name", "finished_reason"], registry=registry)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", label,
                              buckets=TTFT_BUCKETS, registry=registry)
        self.tpot = Histogram("vllm:time_per_output_token_seconds",
                              "Time between tokens (vLLM's deprecated name for vllm:inter_token_latency_seconds)",
                              label, buckets=TPOT_BUCKETS, registry=registry)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency", label,
                             buckets=E2E_BUCKETS, registry=registry)
        self.phases = [Histogram(f"vllm:request_{phase}_time_seconds", f"Time in the {phase} phase", label,
                                 buckets=E2E_BUCKETS, registry=registry) for phase in ("queue", "prefill", "decode")]
        self.inference = Histogram("vllm:request_inference_time_seconds", "Time in the prefill and decode phases",
                                   label, buckets=E2E_BUCKETS, registry=registry)
        self.max_tokens = Histogram("vllm:request_params_max_tokens", "The max_tokens request parameter", label,
                                    buckets=tokens, registry=registry)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between tokens", label,
                             buckets=TPOT_BUCKETS, registry=registry)
        self.n = Histogram("vllm:request_params_n", "The n request parameter", label, buckets=(1, 2, 5, 10, 20),
                           registry=registry)
        self.most_tokens = Histogram("vllm:request_max_num_generation_tokens",
                                     "The most tokens any choice of a request generated", label, buckets=tokens,
                                     registry=registry)

    def request_ended(self, n: int, most_tokens: int) -> None:
        """A request's last choice ended: its n, and its longest choice's tokens."""
        self.n.labels(self.model_name).observe(n)
        self.most_tokens.labels(self.model_name).observe(most_tokens)

    def finished(self, reason: str, prompt_tokens: int, ttft: float | None, tpot: float | None, e2e: float,
                 phases: tuple[float, ...] = (), intervals: list[float] = (), generation_tokens: int = 0,
                 max_tokens: int | None = None) -> None:
        name = self.model_name
        for histogram, seconds in zip(self.phases, phases):
            histogram.labels(name).observe(seconds)
        if len(phases) >= 3:
            self.inference.labels(name).observe(phases[1] + phases[2])
        if max_tokens is not None:
            self.max_tokens.labels(name).observe(max_tokens)
        itl, every_tpot = self.itl.labels(name), self.tpot.labels(name)
        for seconds in intervals:
            itl.observe(seconds)
            every_tpot.observe(seconds)
        self.prompt_tokens.labels(name).inc(prompt_tokens)
        self.request_prompt_tokens.labels(name).observe(prompt_tokens)
        self.request_generation_tokens.labels(name).observe(generation_tokens)
        self.success.labels(name, FINISHED_REASONS.get(reason, "stop")).inc()
        self.e2e.labels(name).observe(e2e)
        if ttft is not None:
            self.ttft.labels(name).observe(ttft)
        if tpot is not None:
            self.request_tpot.labels(name).observe(tpot)

    def generated(self, tokens: int) -> None:
        self.generation_tokens.labels(self.model_name).inc(tokens)


def engine_series(stats: list, model_name: str):
    """vLLM's per-engine gauges and counters from the generators' stats."""
    labels = ["model_name", "engine"]
    running = GaugeMetricFamily("vllm:num_requests_running", "Requests in model execution batches", labels=labels)
    waiting = GaugeMetricFamily("vllm:num_requests_waiting", "Requests waiting to be processed", labels=labels)
    usage = GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV cache usage (1 means 100 percent)", labels=labels)
    preempted = CounterMetricFamily("vllm:num_preemptions", "Preemptions", labels=labels)
    queries = CounterMetricFamily("vllm:prefix_cache_queries", "Prefix cache queries, in prompt tokens", labels=labels)
    hits = CounterMetricFamily("vllm:prefix_cache_hits", "Prefix cache hits, in prompt tokens", labels=labels)
    steps = HistogramMetricFamily("vllm:iteration_tokens_total", "Tokens per engine step", labels=labels)
    config = GaugeMetricFamily("vllm:cache_config_info", "The KV cache's configuration, in its labels",
                               labels=[*labels, "block_size", "num_gpu_blocks", "enable_prefix_caching"])
    generators = sorted((s for s in stats if s.stage == "generator"), key=lambda s: s.instance)
    for engine, s in enumerate(generators):
        key = [model_name, str(engine)]
        steps.add_metric(key, *_iteration_buckets(s.counters))
        caching = str("prefix_cache_queries" in s.counters)   # as vLLM writes the bool
        config.add_metric([*key, str(int(s.gauges.get("kv_block_size", 0))),
                           str(int(s.gauges.get("kv_blocks_total", 0))), caching], 1.0)
        running.add_metric(key, s.gauges.get("running", 0))
        waiting.add_metric(key, s.gauges.get("waiting", 0))
        total = s.gauges.get("kv_blocks_total", 0)
        usage.add_metric(key, s.gauges.get("kv_blocks_used", 0) / total if total else 0.0)
        preempted.add_metric(key, s.counters.get("preemptions", 0))
        queries.add_metric(key, s.counters.get("prefix_cache_queries", 0))
        hits.add_metric(key, s.counters.get("prefix_cache_hits", 0))
    yield from (running, waiting, usage, preempted, queries, hits, steps, config)


def _iteration_buckets(counters: dict) -> tuple[list[tuple[str, float]], float]:
    """A generator's steps-per-token-bucket counters ("iteration_tokens.B",
    every bucket, its bound B in its name) as a histogram's cumulative
    buckets and its sum (the tokens of every step)."""
    prefix = "iteration_tokens."
    counts = {float(k[len(prefix):]): v for k, v in counters.items() if k.startswith(prefix)}   # "inf" reads as inf
    buckets, seen = [], 0
    for bound in sorted(counts):
        seen += counts[bound]
        buckets.append(("+Inf" if bound == float("inf") else str(bound), seen))
    if not buckets or buckets[-1][0] != "+Inf":
        buckets.append(("+Inf", seen))
    total = sum(v for k, v in counters.items() if k.startswith("step_tokens."))
    return buckets, total


def mm_cache_series(stats: list, model_name: str):
    """vLLM's multimodal cache counters, in items, per encoder (its instance
    as the `engine` label: a restarted one's counters start again from 0,
    which a sum over encoders would hide from rate()): every encode job is a
    query, and one served from an embedding the encoder had or was already
    making (its dedup) is a hit."""
    labels = ["model_name", "engine"]
    queries = CounterMetricFamily("vllm:mm_cache_queries", "Multimodal cache queries, in items", labels=labels)
    hits = CounterMetricFamily("vllm:mm_cache_hits", "Multimodal cache hits, in items", labels=labels)
    for s in sorted((s for s in stats if s.stage == "encoder"), key=lambda s: s.instance):
        key = [model_name, s.instance]
        queries.add_metric(key, sum(s.counters.get(k, 0) for k in ("encoded", "dedup", "failed")))
        hits.add_metric(key, s.counters.get("dedup", 0))
    yield from (queries, hits)
