"""The bodies of whole answers and of failed requests, and the deltas of a
streamed chat choice (with its reasoning and its tool calls parsed out where
asked: the tool calls from the content after the reasoning)."""

from __future__ import annotations

import time

from aiohttp import web

from pipeline import protocol
from pipeline.proxy.api_types import ApiError
from pipeline.proxy.reasoning import ReasoningSplit, ReasoningStream
from pipeline.proxy.tool_parser import ToolCallStream, parse_tool_calls

# vLLM's name for a message's reasoning, and the one it had before (older clients read it).
REASONING_FIELDS = ("reasoning", "reasoning_content")


def error_response(delta: protocol.TokenDelta) -> web.Response:
    """A request that ended in failure (already counted by the dispatcher)."""
    status = delta.status or 500
    error = ApiError(delta.error, status=status)
    return web.json_response(error.body(), status=status)


class Usage:
    """A response's token counts as vLLM counts them: each prompt once, however
    many choices it has; with `details` (--enable-prompt-tokens-details), how
    many of the prompts' tokens the generators' prefix caches held."""

    def __init__(self, details: bool) -> None:
        self.details = details
        self.prompt_tokens = self.completion_tokens = self.cached_tokens = 0

    def add(self, last: protocol.TokenDelta, counts_prompt: bool = True) -> Usage:
        """A choice's last delta; counts_prompt: the first choice of its prompt."""
        if counts_prompt:
            self.prompt_tokens += last.prompt_tokens
            self.cached_tokens += last.cached_tokens
        self.completion_tokens += last.completion_tokens
        return self

    def body(self) -> dict:
        out = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
               "total_tokens": self.prompt_tokens + self.completion_tokens}
        if self.details:
            out["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return out


def usage_of(last: protocol.TokenDelta, details: bool = False) -> dict:
    return Usage(details).add(last).body()


def final_usage(req, forced: bool) -> bool:
    """Whether a stream ends with a usage chunk: stream_options.include_usage,
    or the server's --enable-force-include-usage (vLLM's flag)."""
    options = req.stream_options
    return forced or (options is not None and options.include_usage)


def continuous_usage(req) -> bool:
    """vLLM's stream_options.continuous_usage_stats (with include_usage):
    every chunk with tokens carries the counts so far."""
    options = req.stream_options
    return options is not None and options.include_usage and options.continuous_usage_stats


def response_body(rid, model_id, text, last, chat, tools: bool = False, details: bool = False,
                  reasoning: ReasoningSplit | None = None) -> dict:
    """tools: the request's tool calls are parsed out of the text; details:
    usage names the prompt's cached tokens; reasoning: how a chat answer
    splits into reasoning and content (--reasoning-parser)."""
    choice = {"index": 0, "finish_reason": last.finish_reason, "stop_reason": last.stop_reason, "logprobs": None}
    if chat:
        thought, content = reasoning.split(text) if reasoning is not None else (None, text)
        calls = []
        if tools and content is not None:
            content, calls = parse_tool_calls(content)
        choice["message"] = {"role": "assistant", "content": content}
        if reasoning is not None and reasoning.include:
            choice["message"].update(dict.fromkeys(REASONING_FIELDS, thought))
        if calls:
            choice["message"]["tool_calls"] = [call.openai() for call in calls]
            choice["finish_reason"] = tool_finish(last.finish_reason)
    else:
        choice["text"] = text
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model_id, "choices": [choice], "usage": usage_of(last, details)}


def prompt_logprobs_at_top(body: dict) -> dict:
    """Chat's prompt_logprobs, as vLLM places them: once for the response
    (its choices share the prompt), not per choice as text completions'."""
    found = [choice.pop("prompt_logprobs") for choice in body["choices"] if "prompt_logprobs" in choice]
    if found:
        body["prompt_logprobs"] = found[0]
    return body


def tool_finish(reason: str) -> str:
    """An answer with tool calls that the model ended itself ends for them."""
    return "tool_calls" if reason == "stop" else reason


class ChatDeltas:
    """One streamed chat choice: each piece of its text as the delta to send."""

    def __init__(self, tools: bool, reasoning: ReasoningSplit | None = None) -> None:
        self._parser = ToolCallStream() if tools else None
        self._reasoning = ReasoningStream(reasoning) if reasoning is not None else None
        self._include = reasoning is not None and reasoning.include

    @property
    def parses(self) -> bool:
        """Whether a piece may come out as less than its text (held back, or split)."""
        return self._parser is not None or self._reasoning is not None

    def delta(self, text: str, last: bool) -> dict:
        """The delta for this piece; empty where the parsers hold it back."""
        if not self.parses:
            return {"content": text}
        thought, content = self._reasoning.feed(text, last) if self._reasoning is not None else ("", text)
        out = dict.fromkeys(REASONING_FIELDS, thought) if thought and self._include else {}
        calls = None
        if self._parser is not None:
            content, calls = self._parser.feed(content, last)
        if content:
            out["content"] = content
        if calls:
            out["tool_calls"] = calls
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        return tool_finish(reason) if reason and self._parser is not None and self._parser.calls else reason
