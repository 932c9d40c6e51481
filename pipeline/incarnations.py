"""Which incarnation of each peer process we heard from last.

Every stage names a fresh incarnation (protocol.new_incarnation) in what it
sends. A peer restarted faster than any timeout (systemd, epd-launch, a
quick load) comes back at the same address; only a new incarnation tells
that the process there lost what its predecessor held.
"""

from __future__ import annotations


class Incarnations:
    def __init__(self) -> None:
        self._known: dict[str, str] = {}

    def restarted(self, address: str, incarnation: str) -> bool:
        """Note `address`'s incarnation; True if it differs from the one
        noted before (the first one heard is not a restart)."""
        known = self._known.get(address)
        self._known[address] = incarnation
        return known is not None and known != incarnation
