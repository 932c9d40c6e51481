"""How an encoder slows down instead of failing when it is ahead of its
generators.

Under overload every arena entry can be leased (generators park what they
have no room for yet: pipeline/generator/parking.py). A new embedding then
waits for a lease to come back rather than failing its request (it used to
fail with "arena full"), and it gives up, retryably, only after
`patience_s`. Meanwhile decoding stops a few batches ahead of the vision
forward (DECODED_BACKLOG_BATCHES), so decoded pixels (on the GPU with DALI:
173 MB for 8 s of 720p video) do not pile up either; jobs wait as their
compressed bytes.
"""

from __future__ import annotations

import asyncio
import time

DECODED_BACKLOG_BATCHES = 2   # decoded, not yet forwarded: at most this many batches' tokens
ARENA_PATIENCE_S = 30.0       # how long an embedding waits for arena room before its jobs fail


class ArenaSpace:
    def __init__(self, patience_s: float = ARENA_PATIENCE_S) -> None:
        self.patience_s = patience_s
        self._freed = asyncio.Event()
        self._blocked_since: dict[str, float] = {}

    def freed(self) -> None:
        """A lease came back or an entry went: blocked reservations may fit."""
        self._freed.set()

    def keep_waiting(self, key: str) -> bool:
        """`key` found no room: True while it has waited less than patience_s."""
        since = self._blocked_since.setdefault(key, time.monotonic())
        if time.monotonic() - since < self.patience_s:
            return True
        del self._blocked_since[key]
        return False

    def placed(self, key: str) -> None:
        self._blocked_since.pop(key, None)

    async def wait(self, timeout: float) -> None:
        """Until something is freed (or `timeout`, to check patience)."""
        try:
            await asyncio.wait_for(self._freed.wait(), timeout)
        except TimeoutError:
            pass
        self._freed.clear()


def decode_room(max_batch_tokens: int, decoded_tokens: int) -> int:
    """Tokens' worth of jobs the decoder may take now (<= 0: none)."""
    return DECODED_BACKLOG_BATCHES * max_batch_tokens - decoded_tokens
