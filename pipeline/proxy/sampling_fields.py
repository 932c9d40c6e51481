"""A request's sampling fields, read into protocol.Sampling's: stop strings,
the logits processors, the logprobs asked for (the output's and the
prompt's), allowed_token_ids, bad_words and the output options. Each bad value is a
400 naming its field."""

from __future__ import annotations

from pipeline.proxy.api_types import ApiError
from pipeline.sampling_params import MAX_TOP_LOGPROBS


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if any(not s for s in items):
        raise ApiError("stop strings must be non-empty", param="stop")
    if len(items) > 16:
        raise ApiError("at most 16 stop strings", param="stop")
    return tuple(items)


def processor_fields(req, vocab_size: int, defaults: dict | None = None, max_logprobs: int = MAX_TOP_LOGPROBS) -> dict:
    """The request's logits processors and output options as protocol.Sampling fields (unset:
    the checkpoint's default, else off); logit_bias keys are token ids as
    strings, as OpenAI sends them; max_logprobs: the server's --max-logprobs."""
    out = {}
    for name, off in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0),
                      ("min_p", 0.0)):
        value = getattr(req, name)
        out[name] = (defaults or {}).get(name, off) if value is None else value
    bias = []
    for key, value in (req.logit_bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise ApiError(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias") from None
        if not 0 <= token < vocab_size:
            raise ApiError(f"logit_bias token id {token} is not in [0, {vocab_size})", param="logit_bias")
        bias.append((token, value))
    out["logit_bias"] = tuple(sorted(bias))
    out["logprobs"] = logprobs_asked(req, max_logprobs)
    out["allowed_token_ids"] = _allowed_token_ids(req.allowed_token_ids, vocab_size)
    out["prompt_logprobs"] = _prompt_logprobs_asked(req, max_logprobs)
    out["include_stop_str_in_output"] = req.include_stop_str_in_output
    out["skip_special_tokens"] = req.skip_special_tokens
    return out


def _prompt_logprobs_asked(req, max_logprobs: int) -> int | None:
    """vLLM's prompt_logprobs: 0 to max_logprobs top entries per prompt
    token, not with stream (as vLLM: they are not streamed)."""
    asked = req.prompt_logprobs
    if asked is None:
        return None
    if req.stream:
        raise ApiError("prompt_logprobs are not available when stream is true", param="prompt_logprobs")
    if not 0 <= asked <= max_logprobs:
        raise ApiError(f"prompt_logprobs must be in [0, {max_logprobs}], got {asked}{_cap_note(max_logprobs)}",
                       param="prompt_logprobs")
    return asked


def _allowed_token_ids(ids: list[int] | None, vocab_size: int) -> tuple[int, ...]:
    """vLLM's allowed_token_ids: unset is every token; a set one must name at least one, each in the vocabulary."""
    if ids is None:
        return ()
    if not ids:
        raise ApiError("allowed_token_ids must name at least one token (leave it unset for all)",
                       param="allowed_token_ids")
    if bad := [t for t in ids if not 0 <= t < vocab_size]:
        raise ApiError(f"allowed_token_ids: {bad[0]} is not a token id in [0, {vocab_size})",
                       param="allowed_token_ids")
    return tuple(ids)


def logprobs_asked(req, max_logprobs: int = MAX_TOP_LOGPROBS) -> int | None:
    """How many top logprobs per token the request wants (0: only the chosen
    token's), or None: no logprobs; at most max_logprobs (--max-logprobs)."""
    chat = hasattr(req, "messages")
    if chat and req.top_logprobs and not req.logprobs:
        raise ApiError("top_logprobs needs logprobs: true", param="top_logprobs")
    if chat:
        asked = (req.top_logprobs or 0) if req.logprobs else None
    else:
        asked = None if req.logprobs is None or req.logprobs is False else int(req.logprobs)
    if asked is not None and not 0 <= asked <= max_logprobs:
        raise ApiError(f"{'top_logprobs' if chat else 'logprobs'} must be in [0, {max_logprobs}], got "
                       f"{asked}{_cap_note(max_logprobs)}", param="top_logprobs" if chat else "logprobs")
    return asked


def _cap_note(max_logprobs: int) -> str:
    """Where a cap other than the API's own comes from."""
    return "" if max_logprobs == MAX_TOP_LOGPROBS else " (the server's --max-logprobs)"


def bad_words_token_ids(words: list[str] | None, tokenizer) -> tuple[tuple[int, ...], ...]:
    """vLLM's bad_words as token sequences: each word as written at the start
    of a text, and with a space before it (the same word in mid-text) where
    that gives another first token and as many tokens."""
    out: list[tuple[int, ...]] = []
    for word in words or ():
        if not word.strip():
            raise ApiError("bad_words must be non-empty strings", param="bad_words")
        bare = tuple(tokenizer.encode(word.lstrip()))
        spaced = tuple(tokenizer.encode(" " + word.lstrip()))
        out.append(bare)
        if spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return tuple(out)
