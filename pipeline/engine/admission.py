"""Whether a request can be scheduled at all: new, and small enough that
the KV cache, the encoder cache and (aggregated) the local encode budget
could ever hold it. A request that fails here would wait forever."""

from __future__ import annotations

from pipeline.engine.kv_blocks import blocks_needed
from pipeline.engine.plan import SchedulerConfig
from pipeline.engine.request import Request, RequestStatus


def check_admissible(config: SchedulerConfig, request: Request) -> None:
    """ValueError if `request` is not new, or can never run under `config`."""
    rid = request.request_id
    if (request.status is not RequestStatus.WAITING or request.num_computed_tokens
            or request.block_ids or request.output_token_ids):
        raise ValueError(f"request {rid} must be new (waiting, nothing computed or generated)")
    longest = request.num_prompt_tokens + request.sampling_params.max_tokens
    if blocks_needed(longest, config.block_size) > config.num_blocks:
        raise ValueError(f"request {rid}: {longest} tokens need more KV blocks than the "
                         f"{config.num_blocks} the cache has")
    for span in request.image_spans:
        if span.item_tokens > config.encoder_cache_tokens:
            raise ValueError(f"request {rid}: an image of {span.item_tokens} tokens exceeds "
                             f"encoder_cache_tokens={config.encoder_cache_tokens}")
        if config.aggregated and span.item_tokens > config.local_encode_tokens:
            raise ValueError(f"request {rid}: an image of {span.item_tokens} tokens exceeds "
                             f"local_encode_tokens={config.local_encode_tokens}")
