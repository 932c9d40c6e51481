"""Tool calls in a model's output, in the Hermes format that tool-aware chat
templates teach: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
once or several times, with free text around them (vLLM's `hermes` parser).

A block runs from `<tool_call>` to the first `</tool_call>` after it (or to
the end of the output). Whole answers (`parse_tool_calls`): each block whose
JSON parses to a name and an arguments object is a call; any other block
stays in the content as the raw text the model wrote, tags included. The
content is the text outside the calls, as written; when there are calls and
it is only whitespace (the newlines between calls), it is None.

Streamed answers (`ToolCallStream`): text outside the tags goes out as it
comes, holding back only what may begin a tag (and, until other text comes,
whitespace). A block that begins `{"name": "<name>", "arguments": {` (the
order the templates write and the grammar forces) is a call as soon as that
much has come: its name goes out, then the arguments as the model writes
them. A block that does not begin that way is held to its end and then
treated as in a whole answer. So a stream adds up to the whole answer
however it is split, except where a block began as a call and then broke
(cut off by max_tokens, or its JSON went wrong): streamed, it stays the call
sent so far, and the rest of that block is dropped.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field

START, END = "<tool_call>", "</tool_call>"
WS = " \t\n\r"   # JSON's whitespace
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
# The start of a call as the templates write it; "ws" is any JSON whitespace.
_HEADER = ("ws", "{", "ws", '"name"', "ws", ":", "ws", "string", "ws", ",", "ws", '"arguments"', "ws", ":", "ws")


def _strict_json(text: str):
    """json.loads without Python's NaN and Infinity, which are not JSON; a
    model's output nested past Python's recursion limit is not a call either."""
    try:
        return json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def _no_constant(name: str):
    raise ValueError(f"{name} is not JSON")


def _sendable(text: str) -> bool:
    """Whether `text` encodes as UTF-8 (a JSON escape may decode to a lone surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass
class ToolCall:
    name: str
    arguments: str      # a JSON object, as text
    id: str = field(default_factory=call_id)

    def openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def header_of(block: str) -> tuple[str, str | None, int]:
    """("call", name, where the arguments begin) once `block` begins like a
    call whose arguments are an object; ("more", None, 0) while it still
    may; ("no", None, 0) once it cannot."""
    pos, name = 0, None
    for step in _HEADER:
        if step == "ws":
            while pos < len(block) and block[pos] in WS:
                pos += 1
        elif step == "string":
            found = _STRING.match(block, pos)
            if found is None:
                return ("more" if pos == len(block) or block[pos] == '"' else "no"), None, 0
            try:
                name = json.loads(found.group())
            except ValueError:
                return "no", None, 0
            if not name or not _sendable(name):
                return "no", None, 0
            pos = found.end()
        elif block.startswith(step, pos):
            pos += len(step)
        else:
            return ("more" if step.startswith(block[pos:]) else "no"), None, 0
    if pos == len(block):
        return "more", None, 0
    return ("call", name, pos) if block[pos] == "{" else ("no", None, 0)


def parse_block(inner: str) -> ToolCall | None:
    """The call written between one pair of tags, or None if it is not one.
    The arguments are the model's own text where the block is in the
    templates' order, else the parsed object written out again."""
    try:
        found = _strict_json(inner)
    except ValueError:
        return None
    if not (isinstance(found, dict) and isinstance(found.get("name"), str) and found["name"]
            and _sendable(found["name"]) and isinstance(found.get("arguments"), dict)):
        return None
    state, name, start = header_of(inner)
    if state == "call":
        _, end = json.JSONDecoder().raw_decode(inner, start)
        return ToolCall(name, inner[start:end])
    arguments = json.dumps(found["arguments"], ensure_ascii=False)
    return ToolCall(found["name"], arguments if _sendable(arguments) else json.dumps(found["arguments"]))


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole answer's (content, calls)."""
    content, calls, pos = [], [], 0
    while (start := text.find(START, pos)) >= 0:
        end = text.find(END, start + len(START))
        stop = len(text) if end < 0 else end + len(END)
        call = parse_block(text[start + len(START):len(text) if end < 0 else end])
        content.append(text[pos:start])
        if call is None:
            content.append(text[start:stop])
        else:
            calls.append(call)
        pos = stop
    content.append(text[pos:])
    joined = "".join(content)
    return (None if calls and not joined.strip(WS) else joined), calls


def _prefix_hold(text: str, tag: str) -> int:
    """How many characters at the end of `text` may begin `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


@dataclass
class _ValueEnd:
    """Finds where a JSON value that begins with `{` ends, a piece at a time."""
    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    ended: bool = False

    def feed(self, text: str) -> int:
        """How many characters of `text` belong to the value."""
        for i, ch in enumerate(text):
            if self.in_string:
                self.escaped, self.in_string = (False, True) if self.escaped else (ch == "\\", ch != '"')
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.ended = True
                    return i + 1
        return len(text)


class ToolCallStream:
    """One streamed choice's parser: feed() each piece of text as it comes;
    each gives (content, tool-call deltas in the OpenAI shape) to send."""

    def __init__(self) -> None:
        self._mode = "text"      # text, block (its start is being read), whole_block, args, tail
        self._buf = ""           # text read but not yet given out
        self._blank: str | None = ""   # the content while it is only whitespace (held back); None after
        self._value: _ValueEnd | None = None
        self.calls = 0           # calls begun so far
        # Each mode's step: consumes what it can; True when another step may go on.
        self._steps = {"text": self._text, "block": self._block, "whole_block": self._whole_block,
                       "args": self._args, "tail": self._tail}

    def feed(self, text: str, last: bool = False) -> tuple[str, list[dict]]:
        """`last`: the output ends with this piece."""
        self._buf += text
        out = _Out()
        while self._steps[self._mode](out):
            pass
        if last:
            self._finish(out)
        return out.content, out.calls

    def _finish(self, out: _Out) -> None:
        buf, self._buf = self._buf, ""
        if self._mode == "text":
            self._say(buf, out)
        elif self._mode in ("block", "whole_block"):
            self._close(buf, START + buf, out)
        elif self._mode == "args":
            out.arguments(self.calls - 1, buf)
        self._mode = "text"
        if self._blank and not self.calls:   # whitespace alone is content only in an answer without calls
            out.content, self._blank = out.content + self._blank, None

    def _say(self, text: str, out: _Out) -> None:
        if self._blank is None:
            out.content += text
        elif (self._blank + text).strip(WS):
            out.content, self._blank = out.content + self._blank + text, None
        else:
            self._blank += text

    def _text(self, out: _Out) -> bool:
        start = self._buf.find(START)
        if start >= 0:
            self._say(self._buf[:start], out)
            self._buf, self._mode = self._buf[start + len(START):], "block"
            return True
        cut = len(self._buf) - _prefix_hold(self._buf, START)
        self._say(self._buf[:cut], out)
        self._buf = self._buf[cut:]
        return False

    def _block(self, out: _Out) -> bool:
        end = self._buf.find(END)
        state, name, start = header_of(self._buf if end < 0 else self._buf[:end])
        if state == "call":
            out.begin(self.calls, call_id(), name)
            self.calls += 1
            self._buf, self._mode, self._value = self._buf[start:], "args", _ValueEnd()
            return True
        if state == "more" and end < 0:
            return False
        self._mode = "whole_block"
        return True

    def _whole_block(self, out: _Out) -> bool:
        end = self._buf.find(END)
        if end < 0:
            return False
        self._close(self._buf[:end], START + self._buf[:end + len(END)], out)
        self._buf, self._mode = self._buf[end + len(END):], "text"
        return True

    def _args(self, out: _Out) -> bool:
        end = self._buf.find(END)
        region = self._buf[:end] if end >= 0 else self._buf[:len(self._buf) - _prefix_hold(self._buf, END)]
        taken = self._value.feed(region)
        out.arguments(self.calls - 1, region[:taken])
        if self._value.ended:
            self._buf, self._mode = self._buf[taken:], "tail"
        elif end >= 0:   # the block closed inside its arguments: the call stays as sent
            self._buf, self._mode = self._buf[end + len(END):], "text"
        else:
            self._buf = self._buf[taken:]
            return False
        return True

    def _tail(self, out: _Out) -> bool:
        """After a call's arguments: all up to the closing tag is dropped."""
        end = self._buf.find(END)
        if end < 0:
            return False
        self._buf, self._mode = self._buf[end + len(END):], "text"
        return True

    def _close(self, inner: str, raw: str, out: _Out) -> None:
        """A block read whole: a call, or content as written."""
        call = parse_block(inner)
        if call is None:
            self._say(raw, out)
            return
        out.begin(self.calls, call.id, call.name)
        out.arguments(self.calls, call.arguments)
        self.calls += 1


class _Out:
    """What one feed gives out; argument pieces of one call are merged."""

    def __init__(self) -> None:
        self.content = ""
        self.calls: list[dict] = []

    def begin(self, index: int, id: str, name: str) -> None:
        self.calls.append({"index": index, "id": id, "type": "function",
                           "function": {"name": name, "arguments": ""}})

    def arguments(self, index: int, text: str) -> None:
        if not text:
            return
        if self.calls and self.calls[-1]["index"] == index:
            self.calls[-1]["function"]["arguments"] += text
        else:
            self.calls.append({"index": index, "function": {"arguments": text}})
