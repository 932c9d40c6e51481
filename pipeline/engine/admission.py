"""Whether a request can be scheduled at all: new, and small enough that
the KV cache, the encoder cache and (aggregated) the local encode budget
could ever hold it (a request that fails here would wait forever); and
whether the token ids it names are this model's, and its logprobs within
the server's --max-logprobs."""

from __future__ import annotations

from pipeline.engine.kv_blocks import blocks_needed
from pipeline.engine.plan import SchedulerConfig
from pipeline.engine.request import Request, RequestStatus
from pipeline.sampling_params import SamplingParams, check_logprobs


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


def check_params(params: SamplingParams, vocab_size: int, eos_token_ids, max_logprobs: int) -> None:
    """ValueError (a 400) for a token id a request names outside the model's
    vocabulary, allowed tokens that leave none to write, or more top
    logprobs than `max_logprobs`."""
    check_logprobs(params, max_logprobs)
    named = (("logit_bias", [t for t, _ in params.logit_bias]), ("allowed_token_ids", params.allowed_token_ids),
             ("bad_words", [t for word in params.bad_words_token_ids for t in word]))
    for name, tokens in named:
        if any(token >= vocab_size for token in tokens):
            raise ValueError(f"{name} names a token id outside this model's vocabulary of {vocab_size}")
    ends = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
    if params.min_tokens and params.allowed_token_ids and set(params.allowed_token_ids) <= ends:
        # min_tokens bans them all until then: no token would be left to write.
        raise ValueError("every token in allowed_token_ids ends the request, and min_tokens forbids that")
