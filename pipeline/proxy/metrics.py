"""/metrics: the proxy's own request metrics plus every stage's counters and
gauges (from their StageStats replies), labelled by stage and instance; and
the same events under vLLM's names (vllm_metrics.py)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pipeline.proxy.vllm_metrics import VllmSeries, engine_series, mm_cache_series

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60)


class ProxyMetrics:
    def __init__(self, dispatcher, model_name: str = "", max_model_len: int = 1) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("epd_requests", "Requests by final status", ["status"], registry=self.registry)
        self.ttft = Histogram("epd_time_to_first_token_seconds", "Time to first token", buckets=LATENCY_BUCKETS,
                              registry=self.registry)
        self.tpot = Histogram("epd_time_per_output_token_seconds", "Time per output token after the first",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        # Counted as the proxy passed them on, when a request ends (finished,
        # failed or dropped by its client): a request moved to another
        # generator counts each token once.
        self.generation_tokens = Counter("epd_generation_tokens", "Completion tokens sent to clients",
                                         registry=self.registry)
        self.prompt_tokens = Counter("epd_prompt_tokens", "Prompt tokens of requests that finished",
                                     registry=self.registry)
        self.e2e = Histogram("epd_e2e_request_latency_seconds", "Request latency", buckets=LATENCY_BUCKETS,
                             registry=self.registry)
        self.registry.register(_StageCollector(dispatcher, model_name))
        self.vllm = VllmSeries(self.registry, model_name, max_model_len)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def generated(self, tokens: int) -> None:
        """Completion tokens passed on to a client (a request ended, or its client left)."""
        self.generation_tokens.inc(tokens)
        self.vllm.generated(tokens)

    def finished(self, flight, delta, now: float) -> None:
        """A request ended: its status, tokens and latencies."""
        self.requests.labels("error" if delta.error else "ok").inc()
        self.generated(flight.tokens)
        if delta.error:
            return
        self.prompt_tokens.inc(delta.prompt_tokens)
        self.e2e.observe(now - flight.created)
        ttft = tpot = None
        if flight.first_token_at is not None:
            ttft = flight.first_token_at - flight.created
            self.ttft.observe(ttft)
            if flight.tokens > 1:
                tpot = (now - flight.first_token_at) / (flight.tokens - 1)
                self.tpot.observe(tpot)
        self.vllm.finished(delta.finish_reason, delta.prompt_tokens, ttft, tpot, now - flight.created, delta.phases,
                           flight.intervals, flight.tokens, flight.work.request.sampling.max_tokens)
        choices = flight.work.choices
        most = flight.tokens if choices is None else choices.ended(flight.tokens)
        if most is not None:   # the request's last choice: once per request, as vLLM observes them
            self.vllm.request_ended(1 if choices is None else choices.n, most)


# Which StageStats entries become which series.
_STAGE_COUNTERS = {"epd_yields": ("generator", "yields"), "epd_preemptions": ("generator", "preemptions"),
                   "epd_encoder_ring_wakes": ("encoder", "ring_wakes"),
                   # Decode-only steps run while prefill was due (--prefill-pacing-ms).
                   "epd_prefill_held_steps": ("generator", "prefill_held_steps"),
                   # Images a generator encoded itself while no encoder was up (--encode-fallback local).
                   "epd_encode_fallback_local": ("generator", "fallback_encodes")}
_STAGE_GAUGES = {
    "epd_arena_bytes_used": ("encoder", "arena_bytes_used"),
    "epd_arena_leases": ("encoder", "arena_leases"),
    "epd_arena_entries": ("encoder", "arena_entries"),
    "epd_kv_blocks_used": ("generator", "kv_blocks_used"),
    "epd_kv_blocks_total": ("generator", "kv_blocks_total"),
    "epd_running_requests": ("generator", "running"),
    "epd_waiting_requests": ("generator", "waiting"),
    "epd_encoder_cache_tokens": ("generator", "encoder_cache_tokens"),
}


# Running totals that stages report as "PREFIX.LABEL" counters, exported as
# one labelled Prometheus counter each: (name, help, stage, prefix, label, scale).
_LABELLED_COUNTERS = (
    ("epd_generator_steps", "Engine steps by kind (decode, mixed, encode, idle)", "generator", "steps.", "kind", 1),
    ("epd_generator_step_tokens", "Tokens run by engine steps, by kind", "generator", "step_tokens.", "kind", 1),
    ("epd_generator_step_seconds", "Time in engine steps, by kind (rate() of it: the share of time busy)",
     "generator", "step_us.", "kind", 1e-6),
    ("epd_encoder_busy_seconds", "Encoder time decoding images, in vision forwards, and (held) with a forward "
     "held while a generator beside it prefills", "encoder", "busy_us.",
     "phase", 1e-6),
    ("epd_encoder_images", "Images decoded and run through the vision tower", "encoder", "images.", "phase", 1),
    ("epd_encoder_handoffs", "Embeddings handed to generators, by lane (a same-host ring, or the socket)",
     "encoder", "handoffs.", "lane", 1),
    ("epd_embedding_refetches", "Embeddings a generator lost and asked for again: of their encoder, of the "
     "proxy (encoded again), or failed (its requests ended with a 503)", "generator", "refetches.", "how", 1),
)


def _labelled_counters(stats: list):
    for name, doc, stage, prefix, label, scale in _LABELLED_COUNTERS:
        family = CounterMetricFamily(name, doc, labels=["stage", "instance", label])
        for s in stats:
            if s.stage == stage:
                for key, value in s.counters.items():
                    if key.startswith(prefix):
                        family.add_metric([s.stage, s.instance, key[len(prefix):]], value * scale)
        yield family


class _StageCollector:
    def __init__(self, dispatcher, model_name: str) -> None:
        self.dispatcher = dispatcher
        self.model_name = model_name

    def collect(self):
        stats = list(self.dispatcher.stats.values())
        labels = ["stage", "instance"]
        up = GaugeMetricFamily("epd_stage_up", "1 when the stage answered recently", labels=labels)
        for address, s in self.dispatcher.stats.items():
            up.add_metric([s.stage, s.instance], 1.0 if self.dispatcher.up(address) else 0.0)
        yield up
        jobs = CounterMetricFamily("epd_encoder_jobs", "Encode jobs by outcome", labels=labels + ["outcome"])
        for s in stats:
            if s.stage == "encoder":
                for outcome in ("encoded", "dedup", "failed"):
                    jobs.add_metric([s.stage, s.instance, outcome], s.counters.get(outcome, 0))
        yield jobs
        for kind, table, field in ((CounterMetricFamily, _STAGE_COUNTERS, "counters"),
                                   (GaugeMetricFamily, _STAGE_GAUGES, "gauges")):
            for name, (stage, key) in table.items():
                family = kind(name, key, labels=labels)
                for s in stats:
                    if s.stage == stage:
                        family.add_metric([s.stage, s.instance], getattr(s, field).get(key, 0))
                yield family
        yield from _labelled_counters(stats)
        yield from engine_series(stats, self.model_name)
        yield from mm_cache_series(stats, self.model_name)
