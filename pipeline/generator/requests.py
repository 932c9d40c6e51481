"""The generator's request table: the requests it serves (who to answer,
which images are still to come, by when), and the ids it remembers after
they are gone: aborts that overtook their request, and requests that ended
here (whose late embeddings are given back unread)."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.generator.recent_ids import RecentIds

ABORT_MEMORY_S = 60.0    # how long an abort waits for a request that has not arrived
ENDED_MEMORY_S = 60.0    # how long an ended request's late embeddings are given back unread


@dataclass
class Tracked:
    reply_to: str
    missing: set[str]            # image keys not yet delivered
    deadline: float


class RequestTable:
    def __init__(self) -> None:
        self.tracked: dict[str, Tracked] = {}
        self.aborted_early = RecentIds(ABORT_MEMORY_S)
        self.ended = RecentIds(ENDED_MEMORY_S)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.tracked

    def __len__(self) -> int:
        return len(self.tracked)

    def get(self, request_id: str) -> Tracked | None:
        return self.tracked.get(request_id)

    def track(self, request_id: str, reply_to: str, deadline: float) -> Tracked:
        tracked = self.tracked[request_id] = Tracked(reply_to, set(), deadline)
        return tracked

    def end(self, request_id: str) -> Tracked | None:
        """The request is over here (finished, failed, aborted): forget it,
        remember its id. Returns what was tracked, None if it was not."""
        self.ended.add(request_id)
        return self.tracked.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        if self.tracked.pop(request_id, None) is None:
            # Not here yet: an aggregated-mode request is still having its
            # images decoded on the receiver's worker. Dropped when it comes.
            self.aborted_early.add(request_id)
        else:
            self.ended.add(request_id)

    def was_aborted(self, request_id: str) -> bool:
        """True once for a request whose abort came before it."""
        return self.aborted_early.pop(request_id)

    def gone(self, request_id: str) -> bool:
        """Ended here, or aborted before it came: its embeddings are not read."""
        return request_id in self.ended or request_id in self.aborted_early

    def delivered(self, key: str) -> None:
        """`key`'s embedding came: no request waits on it any more."""
        for tracked in self.tracked.values():
            tracked.missing.discard(key)

    def sent_by(self, address: str) -> list[str]:
        return [rid for rid, tracked in self.tracked.items() if tracked.reply_to == address]

    def overdue(self, now: float) -> list[str]:
        """The requests still missing an image past their deadline."""
        return [rid for rid, tracked in self.tracked.items() if tracked.missing and now > tracked.deadline]

    def expire(self, now: float) -> None:
        self.aborted_early.expire(now)
        self.ended.expire(now)
