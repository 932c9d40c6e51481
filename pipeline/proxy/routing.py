"""Choosing stages: encoders by rendezvous hashing on the content hash (a
repeated image goes where its embedding already is; when that encoder is
down, the next in the same order), generators by least outstanding work."""

from __future__ import annotations

import xxhash


def encoder_order(content_hash: str, encoders: list[str]) -> list[str]:
    """Every encoder, best first, for this content: stable per hash, and
    removing one encoder moves only the hashes that lived on it."""
    return sorted(encoders, key=lambda e: xxhash.xxh3_64_intdigest(f"{e}|{content_hash}".encode()), reverse=True)


def least_loaded(generators: list[str], outstanding: dict[str, int]) -> str:
    """The generator with the fewest outstanding tokens (ties: list order)."""
    return min(generators, key=lambda g: outstanding.get(g, 0))
