"""The bodies of whole answers and of failed requests, and the deltas of a
streamed chat choice (with its tool calls parsed out where asked)."""

from __future__ import annotations

import time

from aiohttp import web

from pipeline import protocol
from pipeline.proxy.api_types import ApiError
from pipeline.proxy.tool_parser import ToolCallStream, parse_tool_calls


def error_response(delta: protocol.TokenDelta) -> web.Response:
    """A request that ended in failure (already counted by the dispatcher)."""
    status = delta.status or 500
    error = ApiError(delta.error, status=status)
    return web.json_response(error.body(), status=status)


def usage_of(delta: protocol.TokenDelta) -> dict:
    return {"prompt_tokens": delta.prompt_tokens, "completion_tokens": delta.completion_tokens,
            "total_tokens": delta.prompt_tokens + delta.completion_tokens}


def response_body(rid, model_id, text, last, chat, tools: bool = False) -> dict:
    """tools: the request's tool calls are parsed out of the text."""
    choice = {"index": 0, "finish_reason": last.finish_reason, "stop_reason": last.stop_reason, "logprobs": None}
    if chat and tools:
        content, calls = parse_tool_calls(text)
        choice["message"] = {"role": "assistant", "content": content}
        if calls:
            choice["message"]["tool_calls"] = [call.openai() for call in calls]
            choice["finish_reason"] = tool_finish(last.finish_reason)
    elif chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model_id, "choices": [choice], "usage": usage_of(last)}


def tool_finish(reason: str) -> str:
    """An answer with tool calls that the model ended itself ends for them."""
    return "tool_calls" if reason == "stop" else reason


class ChatDeltas:
    """One streamed chat choice: each piece of its text as the delta to send."""

    def __init__(self, tools: bool) -> None:
        self._parser = ToolCallStream() if tools else None

    def delta(self, text: str, last: bool) -> dict:
        """The delta for this piece; empty where the tool-call parser holds it back."""
        if self._parser is None:
            return {"content": text}
        content, calls = self._parser.feed(text, last)
        out = {"content": content} if content else {}
        if calls:
            out["tool_calls"] = calls
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        return tool_finish(reason) if reason and self._parser is not None and self._parser.calls else reason
