"""The generator's local encoder cache: image embeddings by content hash.

A ledger of token counts, users and freed keys; the payload is whatever the
engine stores (a tensor, an arena handle) and is never looked into here.

Rules:
- capacity is counted in embedding tokens; `admit` refuses what does not fit
  (the caller keeps the arrival pending and retries) and never evicts;
- users are request ids that still have to read the embedding. A key may have
  users before its entry arrives; that is how a pending image is waited for;
- an entry is freed as soon as its last user leaves; an entry admitted for a
  key nobody uses stays only until the next `free_unused()`;
- `make_room` may evict entries that still have users (the owner decides which
  are protected); their users stay registered and wait for the key again;
- the memory owner drains freed keys with `drain_freed()` to drop tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class _Entry:
    num_tokens: int
    payload: Any


class EncoderCache:
    def __init__(self, capacity_tokens: int) -> None:
        if capacity_tokens < 0:
            raise ValueError(f"capacity_tokens must be >= 0, got {capacity_tokens}")
        self.capacity_tokens = capacity_tokens
        self.used_tokens = 0
        self._entries: dict[str, _Entry] = {}
        self._users: dict[str, set[str]] = {}
        self._freed: dict[str, None] = {}   # insertion-ordered set

    # ---------------------------------------------------------------- entries

    def admit(self, key: str, num_tokens: int, payload: Any = None) -> bool:
        """Store an embedding of `num_tokens` tokens. False if it does not fit
        now. Re-admitting a present key is a no-op True (the first payload
        stays); a different token count for the same key is a ValueError."""
        if num_tokens < 1:
            raise ValueError(f"an embedding needs at least one token, got {num_tokens} for {key}")
        present = self._entries.get(key)
        if present is not None:
            if present.num_tokens != num_tokens:
                raise ValueError(f"embedding {key} has {present.num_tokens} tokens in the cache, "
                                 f"{num_tokens} offered")
            return True
        if self.used_tokens + num_tokens > self.capacity_tokens:
            return False
        self._entries[key] = _Entry(num_tokens, payload)
        self.used_tokens += num_tokens
        # A key freed and admitted again before the owner drained: drain_freed
        # only reports keys that are absent, so the new payload is not dropped.
        self._freed.pop(key, None)
        return True

    def set_payload(self, key: str, payload: Any) -> None:
        """Fill an entry admitted without a payload (a space reservation made
        at planning time, e.g. for a local encode in aggregated mode)."""
        self._entries[key].payload = payload

    def contains(self, key: str) -> bool:
        return key in self._entries

    def get(self, key: str) -> Any:
        """The payload; KeyError if the key is absent."""
        return self._entries[key].payload

    def num_tokens(self, key: str) -> int:
        return self._entries[key].num_tokens

    def fits(self, num_tokens: int) -> bool:
        return self.used_tokens + num_tokens <= self.capacity_tokens

    @property
    def free_tokens(self) -> int:
        return self.capacity_tokens - self.used_tokens

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[str]:
        return list(self._entries)

    # ------------------------------------------------------------------ users

    def add_user(self, key: str, request_id: str) -> None:
        self._users.setdefault(key, set()).add(request_id)

    def release_user(self, key: str, request_id: str) -> None:
        """The request no longer needs `key`; the entry is freed with its last
        user. Releasing a user that is not registered raises KeyError."""
        users = self._users.get(key)
        if users is None or request_id not in users:
            raise KeyError(f"request {request_id} is not a user of {key}")
        users.discard(request_id)
        if not users:
            del self._users[key]
            self._free(key)

    def users(self, key: str) -> frozenset[str]:
        return frozenset(self._users.get(key, ()))

    def is_needed(self, key: str) -> bool:
        """Whether some request still has to read `key`: an arrival for a key
        nobody needs would be freed by the next free_unused()."""
        return key in self._users

    def num_users_total(self) -> int:
        return sum(len(u) for u in self._users.values())

    # --------------------------------------------------------------- freeing

    def free_unused(self) -> list[str]:
        """Free every entry without users; returns the keys freed."""
        unused = [key for key in self._entries if key not in self._users]
        for key in unused:
            self._free(key)
        return unused

    def evictable_tokens(self, protected: set[str]) -> int:
        return sum(e.num_tokens for key, e in self._entries.items() if key not in protected)

    def make_room(self, num_tokens: int, protected: set[str],
                  last_resort: set[str] = frozenset()) -> list[str] | None:
        """Evict entries outside `protected` until `num_tokens` more fit:
        entries nobody uses first, then used ones, `last_resort` keys last,
        oldest first within each group. Returns the evicted keys, or None
        (and nothing evicted) if even all of them would not make room."""
        if self.fits(num_tokens):
            return []
        candidates = sorted((k for k in self._entries if k not in protected),
                            key=lambda k: (k in self._users, k in last_resort))   # stable sort
        victims, room = [], self.free_tokens
        for key in candidates:
            if room >= num_tokens:
                break
            victims.append(key)
            room += self._entries[key].num_tokens
        if room < num_tokens:
            return None
        for key in victims:
            self._free(key)
        return victims

    def drain_freed(self) -> list[str]:
        """Keys freed since the last drain that are still absent, oldest first."""
        freed = list(self._freed)
        self._freed.clear()
        return freed

    def _free(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return  # users of an embedding that never arrived: nothing held
        self.used_tokens -= entry.num_tokens
        self._freed[key] = None
