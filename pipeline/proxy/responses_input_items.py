"""`GET /v1/responses/{id}/input_items`: a stored response's input items, a
page at a time, as OpenAI's API lists them.

The items are the request's own `input` (not the turns it went on from
through `previous_response_id`, which are their own responses' items), in
the item form OpenAI returns: each with a `type` and an `id` (one made here
where the client sent none), a message's string content as one text part.
They are kept with the stored response (responses_store.py), so they go
when it goes.
"""

from __future__ import annotations

from collections.abc import Mapping

from pipeline.proxy.api_types import ApiError
from pipeline.proxy.responses_output import new_id

DEFAULT_LIMIT, MAX_LIMIT = 20, 100
_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def input_items_of(given: str | list[dict]) -> list[dict]:
    """A request's input as the items a listing returns (the input was
    checked already: conversation_of read it)."""
    if isinstance(given, str):
        return [_message({"role": "user", "content": given})]
    items = []
    for item in given:
        kind = item.get("type", "message")
        if kind == "message":
            items.append(_message(item))
        else:
            items.append({**item, "id": item.get("id") or new_id(_ID_PREFIXES.get(kind, "item"))})
    return items


def _message(item: dict) -> dict:
    content = item.get("content")
    if isinstance(content, str):
        part = "output_text" if item.get("role") == "assistant" else "input_text"
        content = [{"type": part, "text": content}]
    return {**item, "type": "message", "id": item.get("id") or new_id("msg"),
            "status": item.get("status", "completed"), "content": content}


def input_items_page(items: list[dict], query: Mapping[str, str]) -> dict:
    """One page of `items` by the listing's query: `order` (desc, the
    default, or asc), `after` and `before` (item ids, in that order) and
    `limit` (1 to 100, default 20). As in OpenAI's lists, a page `after` an
    item starts next to it, and so does one `before` it, going back (the
    page still in the list's order); `has_more` says whether more lie that way."""
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ApiError(f"order must be asc or desc, got {order!r}", param="order")
    try:
        limit = int(query.get("limit", DEFAULT_LIMIT))
    except ValueError:
        raise ApiError(f"limit must be an integer, got {query['limit']!r}", param="limit") from None
    if not 1 <= limit <= MAX_LIMIT:
        raise ApiError(f"limit must be in [1, {MAX_LIMIT}], got {limit}", param="limit")
    if "include" in query or "include[]" in query:
        raise ApiError("include: input items are listed as they were sent, with nothing to add", param="include")
    ordered = items if order == "asc" else items[::-1]
    ids = [item["id"] for item in ordered]
    start = _index(ids, query, "after") + 1 if "after" in query else 0
    end = _index(ids, query, "before") if "before" in query else len(ordered)
    window = ordered[start:end]
    page = window[-limit:] if "before" in query and "after" not in query else window[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(window) > limit}


def _index(ids: list[str], query: Mapping[str, str], name: str) -> int:
    try:
        return ids.index(query[name])
    except ValueError:
        raise ApiError(f"{name}: no input item {query[name]!r} in this response", param=name) from None
