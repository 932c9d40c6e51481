"""The Responses API's answers: the response object, its output items (a
reasoning item, the assistant's message, each function call), its usage,
and the server-sent events of a streamed one, as OpenAI's API writes them.

A streamed answer opens each output item as its first text comes (reasoning,
then the message, then the calls), and closes it when the next one opens or
the answer ends; `response.completed` carries the whole response, equal to
the one a request without `stream` gets, its status "incomplete" where it
ran out of max_output_tokens (as vLLM sends it, and as the openai SDK's
stream helper wants it: it takes no `response.incomplete` as the end), and
`response.failed` ends one that failed.
"""

from __future__ import annotations

import secrets

from pipeline import protocol


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def reasoning_tokens(token_ids, end_id: int | None) -> int:
    """The answer's tokens up to its reasoning's end (`end_id`; all of them
    if it never ended); 0 without a reasoning split."""
    if end_id is None:
        return 0
    ids = list(token_ids)
    return ids.index(end_id) if end_id in ids else len(ids)


def usage(last: protocol.TokenDelta, reasoning: int) -> dict:
    return {"input_tokens": last.prompt_tokens, "input_tokens_details": {"cached_tokens": last.cached_tokens},
            "output_tokens": last.completion_tokens, "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": last.prompt_tokens + last.completion_tokens}


def status_of(finish_reason: str) -> tuple[str, dict | None]:
    """(status, incomplete_details) of an answer that ended for `finish_reason`."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    return "completed", None


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": item_id, "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if text else []}


def message_item(item_id: str, text: str, logprobs: list | None, status: str = "completed") -> dict:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status,
            "content": [output_text(text, logprobs)] if text or status == "completed" else []}


def output_text(text: str, logprobs: list | None) -> dict:
    part = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return part


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def output_of(message: dict, logprobs: list | None) -> list[dict]:
    """A chat choice's message (responses.response_body) as output items."""
    items = []
    if message.get("reasoning"):
        items.append(reasoning_item(new_id("rs"), message["reasoning"]))
    if message.get("content") or not (message.get("tool_calls") or message.get("reasoning")):
        items.append(message_item(new_id("msg"), message.get("content") or "", logprobs))
    for call in message.get("tool_calls") or ():
        items.append(call_item(new_id("fc"), call["id"], call["function"]["name"], call["function"]["arguments"]))
    return items


def response_object(rid: str, created: int, model: str, req, sampling: protocol.Sampling | None,
                    stored: bool) -> dict:
    """The response's fields before its output: what was asked, as asked."""
    reasoning = req.reasoning
    fmt = req.text.format if req.text is not None and req.text.format is not None else None
    return {
        "id": rid, "object": "response", "created_at": created, "status": "in_progress", "background": False,
        "error": None, "incomplete_details": None, "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens, "model": model, "output": [],
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": reasoning.effort if reasoning else None,
                      "summary": reasoning.summary if reasoning else None},
        "service_tier": req.service_tier or "auto", "store": stored,
        "temperature": sampling.temperature if sampling is not None else req.temperature,
        "top_p": sampling.top_p if sampling is not None else req.top_p,
        "top_logprobs": req.top_logprobs or 0,
        "text": {"format": _format_echo(fmt)}, "tool_choice": req.tool_choice or ("auto" if req.tools else "none"),
        "tools": req.tools or [], "truncation": req.truncation or "disabled", "usage": None,
        "user": req.user, "metadata": req.metadata or {},
    }


def _format_echo(fmt) -> dict:
    if fmt is None:
        return {"type": "text"}
    out = {"type": fmt.type}
    for key in ("name", "schema", "description", "strict"):
        if getattr(fmt, key) is not None:
            out[key] = getattr(fmt, key)
    return out


def finished(response: dict, output: list[dict], last: protocol.TokenDelta, reasoning: int) -> dict:
    status, details = status_of(last.finish_reason)
    return {**response, "status": status, "incomplete_details": details, "output": output,
            "usage": usage(last, reasoning)}


class ResponseEvents:
    """A streamed response's events, from ChatDeltas' pieces (a dict with
    any of reasoning, content and tool_calls) to the closing one. Logprobs
    ride on the message's text: a piece's entries wait for the next text of
    the message (a thinking model's reasoning tokens have entries too)."""

    def __init__(self, response: dict, logprobs: bool) -> None:
        self.response = response
        self.output: list[dict] = []   # closed items
        self._seq = 0
        self._open: dict | None = None   # the item being written
        self._text = ""                  # its text (or arguments) so far
        self._logprobs = logprobs
        self._entries: list = []         # the message's logprobs so far
        self._pending: list = []         # entries waiting for the message's next text
        self._message: dict | None = None   # the message item, once closed

    def event(self, kind: str, **fields) -> dict:
        out = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return out

    def opening(self) -> list[dict]:
        return [self.event("response.created", response=self.response),
                self.event("response.in_progress", response=self.response)]

    def queued(self, queued: dict) -> list[dict]:
        """A background response's first events, before its generator has answered."""
        return [self.event("response.created", response=queued), self.event("response.queued", response=queued)]

    def in_progress(self) -> list[dict]:
        return [self.event("response.in_progress", response=self.response)]

    def cut(self) -> list[dict]:
        """A cancelled answer's last events: the item being written closed as
        incomplete. No response event follows (the API has none for a
        cancel); GET reads the response as cancelled."""
        return self._close("incomplete")

    def piece(self, delta: dict, logprobs: list | None = None) -> list[dict]:
        """The events for one chat delta; `logprobs`: its tokens' entries."""
        self._pending += logprobs or ()
        out = []
        if text := delta.get("reasoning"):
            out += self._write("reasoning", text)
        if text := delta.get("content"):
            out += self._write("message", text)
        for call in delta.get("tool_calls") or ():
            out += self._call(call)
        return out

    def closing(self, last: protocol.TokenDelta, reasoning: int) -> tuple[list[dict], dict]:
        """The events that end the answer, and the whole response."""
        if not self.output and self._open is None:   # an empty answer is an empty message, as whole
            out = self._begin("message")
        else:
            out = []
        if self._open is not None and self._open["type"] == "message":
            self._entries += self._pending
        elif self._message is not None and self._logprobs:   # the calls' tokens: the message's list, as whole
            self._message["content"][0]["logprobs"] += self._pending
        out += self._close()
        whole = finished(self.response, self.output, last, reasoning)
        return out + [self.event("response.completed", response=whole)], whole

    def failed(self, message: str, status: int) -> list[dict]:
        """The events that end a failed answer: the item being written closed
        as incomplete (so every item added is done), then response.failed
        with the output so far."""
        code = "server_error" if status >= 500 else "invalid_request"
        out = self._close("incomplete")
        return out + [self.event("response.failed", response={**self.response, "status": "failed",
                                                              "output": self.output,
                                                              "error": {"code": code, "message": message}})]

    # ------------------------------------------------------------ the items

    def _write(self, kind: str, text: str) -> list[dict]:
        out = []
        if self._open is None or self._open["type"] != kind:
            out += self._close() + self._begin(kind)
        where = self._where()
        self._text += text
        if kind == "reasoning":
            return out + [self.event("response.reasoning_text.delta", **where, content_index=0, delta=text)]
        sent, self._pending = self._pending, []
        self._entries += sent
        return out + [self.event("response.output_text.delta", **where, content_index=0, delta=text,
                                 logprobs=sent)]

    def _call(self, call: dict) -> list[dict]:
        out = []
        if "id" in call:   # a new call begins
            out += self._close()
            out += self._added(call_item(new_id("fc"), call["id"], call["function"]["name"], "", "in_progress"))
        arguments = call["function"].get("arguments") or ""
        if arguments:
            self._text += arguments
            out.append(self.event("response.function_call_arguments.delta", **self._where(), delta=arguments))
        return out

    def _begin(self, kind: str) -> list[dict]:
        if kind == "reasoning":
            return self._added(reasoning_item(new_id("rs"), "", "in_progress")) + [
                self.event("response.content_part.added", **self._where(), content_index=0,
                           part={"type": "reasoning_text", "text": ""})]
        return self._added(message_item(new_id("msg"), "", None, "in_progress")) + [
            self.event("response.content_part.added", **self._where(), content_index=0,
                       part=output_text("", [] if self._logprobs else None))]

    def _added(self, item: dict) -> list[dict]:
        self._open, self._text = item, ""
        return [self.event("response.output_item.added", output_index=len(self.output), item=item)]

    def _where(self) -> dict:
        return {"item_id": self._open["id"], "output_index": len(self.output)}

    def _close(self, status: str = "completed") -> list[dict]:
        if self._open is None:
            return []
        item, where, text = self._open, self._where(), self._text
        if item["type"] == "function_call":
            done = {**item, "arguments": text, "status": status}
            out = [self.event("response.function_call_arguments.done", **where, name=item["name"], arguments=text)]
        elif item["type"] == "reasoning":
            done = reasoning_item(item["id"], text, status)
            part = {"type": "reasoning_text", "text": text}
            out = [self.event("response.reasoning_text.done", **where, content_index=0, text=text),
                   self.event("response.content_part.done", **where, content_index=0, part=part)]
        else:
            done = self._message = message_item(item["id"], text, self._entries if self._logprobs else None,
                                                status)
            out = [self.event("response.output_text.done", **where, content_index=0, text=text,
                              logprobs=list(self._entries)),
                   self.event("response.content_part.done", **where, content_index=0, part=done["content"][0])]
        self.output.append(done)
        self._open = None
        return out + [self.event("response.output_item.done", output_index=len(self.output) - 1, item=done)]
