"""What a generator reports to the proxy (its /metrics and its load
balancing): gauges of its queues and memory, and counters since start."""

from __future__ import annotations

from pipeline import protocol


def generator_stats(service) -> protocol.StageStats:
    """`service` is a GeneratorService (not imported: it imports this)."""
    gauges = {**service.engine.load(),
              "parked_embeddings": float(len(service.parking)),
              "early_embeddings": float(len(service.early)),
              "refetching_embeddings": float(len(service.refetches)),
              "local_encode_queue": float(len(service.local.queue) if service.local is not None else 0)}
    counters = dict(service.counters, **service.engine.counters())
    return protocol.StageStats("generator", service.address, counters, gauges, service.address,
                               service.incarnation)
