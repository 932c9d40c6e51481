"""Reading and checking config.json fields, shared by the families' config
parsers: each error is a ValueError that names the field."""

from __future__ import annotations

from typing import Any


def int_field(d: dict[str, Any], key: str, default: Any) -> int:
    """d[key] (or default when absent) as a non-negative int."""
    value = d.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"config field {key!r} must be a non-negative integer, got {value!r}")
    return value


def check_divides(name: str, value: int, by_name: str, by: int) -> None:
    if by <= 0 or value % by:
        raise ValueError(f"{name} ({value}) must be a positive multiple of {by_name} ({by})")


def eos_token_ids(d: dict[str, Any]) -> tuple[int, ...]:
    """`eos_token_id`, which config.json writes as one id, a list, or null."""
    eos = d.get("eos_token_id")
    return tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())


# The hub's media token ids, and the ids these checkpoints' tokenizers give
# them where a config leaves them out.
_MEDIA_TOKENS = (("image_token_id", 151655), ("video_token_id", 151656),
                 ("vision_start_token_id", 151652), ("vision_end_token_id", 151653))


def media_token_fields(raw: dict[str, Any]) -> dict[str, int]:
    """image_token_id, video_token_id, vision_start_token_id and vision_end_token_id of a config.json."""
    return {name: int_field(raw, name, default) for name, default in _MEDIA_TOKENS}
