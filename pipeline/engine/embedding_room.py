"""Room in the encoder cache for an embedding that arrived from an encoder
(disaggregated mode), under the scheduler's liveness rule (scheduler.py):
entries are evicted only for an image some request reads next, and never
the next images of running requests nor what a plan in flight reads."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from pipeline.engine.encoder_cache import EncoderCache
from pipeline.engine.plan import StepPlan
from pipeline.engine.request import Request


def next_keys(requests: Iterable[Request]) -> set[str]:
    """The image each request reads next (its first unconsumed span)."""
    return {key for r in requests if (key := r.next_image_key()) is not None}


def keys_read(plan: StepPlan) -> set[str]:
    return {span.key for chunk in plan.chunks for span in chunk.image_spans_in_chunk}


def admit_arrived(cache: EncoderCache, requests: Mapping[str, Request], running: list[Request],
                  waiting: Iterable[Request], in_flight: set[str], key: str, num_tokens: int,
                  payload: object) -> tuple[bool, list[str]]:
    """(admitted, the keys evicted for it). ValueError if its token count
    differs from a placeholder run of a request that needs it."""
    lengths = {s.item_tokens for rid in cache.users(key) for s in requests[rid].image_spans if s.key == key}
    if lengths - {num_tokens}:
        # A reused id for different content: never splice it silently.
        raise ValueError(f"embedding {key} has {num_tokens} tokens; its requests "
                         f"{sorted(cache.users(key))} have placeholder runs of {sorted(lengths)}")
    if cache.admit(key, num_tokens, payload):
        return True, []
    running_next, waiting_next = next_keys(running), next_keys(waiting)
    if key in running_next:
        protected, last_resort = running_next | in_flight, waiting_next
    elif key in waiting_next:
        protected, last_resort = running_next | waiting_next | in_flight, set()
    else:
        return False, []
    evicted = cache.make_room(num_tokens, protected, last_resort)
    if evicted is None:
        return False, []
    return cache.admit(key, num_tokens, payload), evicted
