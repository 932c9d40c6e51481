"""Fields a request body carries that no API here defines, as vLLM treats
them: ignored, with a warning naming them, so that a client written for a
newer vLLM (or another server) still gets its answer. Every field that
OpenAI's API or vLLM's defines is typed in api_types.py, and acted on or
refused with a 400; this is only for the rest.

Logged once per set of names (a client that always sends one would
otherwise write a line per request)."""

from __future__ import annotations

import functools
import logging

import msgspec

log = logging.getLogger("epd.proxy")

_top_level = msgspec.json.Decoder(dict[str, msgspec.Raw])   # the keys only: values are not decoded


def decode_warning_of_unknown(body: bytes, strict: msgspec.json.Decoder, lenient: msgspec.json.Decoder,
                              kind: type[msgspec.Struct]):
    """The body as `kind`. `strict` decodes a subclass of it that forbids
    unknown fields: one decode for a body with none, the common case. Only
    a body with some is read again, for their names, and then leniently.
    Raises msgspec's errors as they come (a nested Struct that forbids
    unknown fields still refuses them)."""
    try:
        return strict.decode(body)
    except msgspec.ValidationError as exc:
        if not str(exc).startswith("Object contains unknown field"):
            raise
    warn_ignored(body, kind)
    return lenient.decode(body)


def warn_ignored(body: bytes, kind: type[msgspec.Struct]) -> tuple[str, ...]:
    """The body's top-level fields that `kind` does not have (sorted), warned about once per set."""
    try:
        keys = _top_level.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return ()   # the Struct's own decode has already said what is wrong
    ignored = tuple(sorted(set(keys) - set(kind.__struct_fields__)))
    if ignored:
        _warn(kind.__name__, ignored)
    return ignored


@functools.lru_cache(maxsize=256)
def _warn(kind: str, ignored: tuple[str, ...]) -> None:
    log.warning("the following fields were present in the request but ignored (no API served here defines "
                "them): %s (%s)", ", ".join(ignored), kind)
