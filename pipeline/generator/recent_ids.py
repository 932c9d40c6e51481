"""Request ids remembered for a while: aborts that came before their
request, and requests that ended here (whose late embeddings are not read)."""

from __future__ import annotations

import time
from collections import OrderedDict


class RecentIds:
    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self._at: OrderedDict[str, float] = OrderedDict()   # oldest first: expiry stops at the first young one

    def add(self, request_id: str) -> None:
        self._at[request_id] = time.monotonic()
        self._at.move_to_end(request_id)

    def pop(self, request_id: str) -> bool:
        """Forget `request_id`; True if it was remembered."""
        return self._at.pop(request_id, None) is not None

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._at

    def expire(self, now: float) -> None:
        while self._at:
            request_id, at = next(iter(self._at.items()))
            if now - at <= self.ttl_s:
                return
            del self._at[request_id]

    def __len__(self) -> int:
        return len(self._at)
