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
