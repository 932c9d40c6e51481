"""What a generator reports to the proxy (its /metrics and its load
balancing): gauges of its queues and memory, and counters since start."""

from __future__ import annotations

from pipeline import protocol


def generator_stats(service) -> protocol.StageStats:
    """`service` is a GeneratorService (not imported: it imports this)."""
    scheduler = service.engine.scheduler
    gauges = {"kv_blocks_used": float(scheduler.block_pool.num_used),
              "kv_blocks_total": float(scheduler.block_pool.num_used + scheduler.block_pool.num_free),
              "running": float(scheduler.num_running), "waiting": float(scheduler.num_waiting),
              "encoder_cache_tokens": float(scheduler.encoder_cache.used_tokens),
              "pending_embeddings": float(len(service.engine.pending_embeddings)),
              "parked_embeddings": float(len(service.parking)),
              "early_embeddings": float(len(service.early)),
              "refetching_embeddings": float(len(service.refetches)),
              "local_encode_queue": float(len(service.local.queue) if service.local is not None else 0)}
    counters = dict(service.counters, yields=scheduler.stats["yields_total"],
                    preemptions=scheduler.stats["preemptions_total"], **service.engine.profile.counters())
    return protocol.StageStats("generator", service.address, counters, gauges, service.address,
                               service.incarnation)
