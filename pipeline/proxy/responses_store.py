"""Stored responses (`store`, on by default as in OpenAI's API): each
answer with the conversation that led to it and its request's input items,
so that `previous_response_id` can go on from it, `GET /v1/responses/{id}`
can read it back and `GET /v1/responses/{id}/input_items` list its input.

Kept in the proxy's memory, within a bound in bytes (`--responses-store-mb`;
0 keeps none, and responses then say `"store": false`). The oldest go first
when a new one does not fit, so a conversation that waits long enough may
find its start gone: a 404, as for an id never stored. (vLLM keeps every
response, without bound, and only when VLLM_ENABLE_RESPONSES_API_STORE is set.)
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import msgspec


@dataclass(frozen=True)
class Stored:
    response: dict        # the response object as it was answered
    conversation: list    # chat messages up to and including its answer, without its instructions
    input_items: list     # the request's input, as the listing returns it (responses_input_items.py)
    size: int


class ResponseStore:
    def __init__(self, limit_bytes: int) -> None:
        self.limit = limit_bytes
        self.used = 0
        self._entries: OrderedDict[str, Stored] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.limit > 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: dict, conversation: list, input_items: list) -> bool:
        """Whether it was kept (one larger than the whole store is not)."""
        size = sum(len(msgspec.json.encode(part)) for part in (response, conversation, input_items))
        if size > self.limit:
            return False
        self.pop(response["id"])
        while self.used + size > self.limit:
            _, oldest = self._entries.popitem(last=False)
            self.used -= oldest.size
        self._entries[response["id"]] = Stored(response, conversation, input_items, size)
        self.used += size
        return True

    def get(self, response_id: str) -> Stored | None:
        found = self._entries.get(response_id)
        if found is not None:
            self._entries.move_to_end(response_id)   # a conversation in use stays
        return found

    def pop(self, response_id: str) -> Stored | None:
        found = self._entries.pop(response_id, None)
        if found is not None:
            self.used -= found.size
        return found
