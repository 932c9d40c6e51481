"""OpenAI's Responses API (`POST /v1/responses`) read as a chat request.

A Responses request is a conversation (`instructions`, the stored turns of
`previous_response_id`, then `input`) and options under other names. Here it
becomes the ChatCompletionRequest that says the same, so the prompt, the
media, the sampling checks, the tools, the grammar and the reasoning split
are the chat API's own; responses_output.py shapes the answer back.

Input items, as OpenAI's and vLLM's servers take them:
- a message: `{"role", "content"}` (with or without `"type": "message"`),
  content a string or parts: `input_text`, `input_image` (`image_url`),
  an earlier answer's `output_text` and `refusal`, and the chat API's own
  parts (`text`, `image_url`, `video_url`). Role `developer` is `system`,
  which is what the chat templates served here know;
- `function_call` (an earlier answer's call) joins the assistant message
  before it, as chat's `tool_calls`; `function_call_output` is a `tool`
  message answering its `call_id`;
- `reasoning` items are left out: the templates served here render no
  earlier turn's reasoning.
Anything else is a 400 naming it.
"""

from __future__ import annotations

import msgspec

from pipeline.proxy.api_types import (EFFORTS, ApiError, ChatCompletionRequest, MediaProcessorKwargs,
                                      StructuredOutputs, decode_json)

LOGPROBS_INCLUDE = "message.output_text.logprobs"


class TextFormat(msgspec.Struct):
    type: str = "text"
    name: str | None = None
    schema: dict | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct):
    format: TextFormat | None = None
    verbosity: str | None = None


class ReasoningConfig(msgspec.Struct):
    effort: str | None = None
    summary: str | None = None            # accepted: reasoning items carry the reasoning itself
    generate_summary: str | None = None   # the older name of summary


class ResponsesRequest(msgspec.Struct):
    input: str | list[dict] | None = None
    model: str | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    truncation: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None   # a routing hint: the prefix cache needs no key
    service_tier: str | None = None
    background: bool = False   # responses_background.py
    # Refused unless off (_REFUSED): nothing here stores prompts or conversations.
    prompt: dict | None = None
    conversation: str | dict | None = None
    max_tool_calls: int | None = None
    # vLLM's extra fields, as on its chat API.
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    priority: int = 0
    cache_salt: str | None = None
    mm_processor_kwargs: MediaProcessorKwargs | None = None
    structured_outputs: StructuredOutputs | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    chat_template_kwargs: dict[str, object] | None = None


_REFUSED = {"prompt": "stored prompts", "conversation": "stored conversations", "max_tool_calls": "max_tool_calls"}
_SERVICE_TIERS = (None, "auto", "default")


class _StrictResponses(ResponsesRequest, forbid_unknown_fields=True):
    """ResponsesRequest that refuses a field it lacks (ignored_fields.py)."""


_STRICT, _LENIENT = msgspec.json.Decoder(_StrictResponses), msgspec.json.Decoder(ResponsesRequest)


def parse_responses_body(body: bytes) -> ResponsesRequest:
    req = decode_json(body, ResponsesRequest, _LENIENT, _STRICT)
    if req.input is None or req.input == "" or req.input == []:
        raise ApiError("input must be a non-empty string or list of items", param="input")
    for name, what in _REFUSED.items():
        if getattr(req, name) not in (None, False):
            raise ApiError(f"'{name}' is not supported by this server ({what}); leave it unset", param=name)
    if req.service_tier not in _SERVICE_TIERS:
        raise ApiError(f"service_tier {req.service_tier!r}: this server has one tier (auto or default)",
                       param="service_tier")
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise ApiError(f"max_output_tokens must be at least 1, got {req.max_output_tokens}",
                       param="max_output_tokens")
    if req.truncation not in (None, "disabled", "auto"):
        raise ApiError(f"truncation must be 'auto' or 'disabled', got {req.truncation!r}", param="truncation")
    if unknown := [item for item in req.include or () if item != LOGPROBS_INCLUDE]:
        raise ApiError(f"include {unknown[0]!r} is not served here (only {LOGPROBS_INCLUDE!r})", param="include")
    if req.metadata is not None and len(req.metadata) > 16:
        raise ApiError("metadata takes at most 16 keys", param="metadata")
    if req.reasoning is not None and req.reasoning.effort not in (None, *EFFORTS):
        raise ApiError(f"reasoning.effort must be one of {', '.join(EFFORTS)}", param="reasoning")
    if req.text is not None and req.text.verbosity not in (None, "medium"):
        raise ApiError("text.verbosity: the models served here take no verbosity (leave it unset or medium)",
                       param="text")
    return req


def wants_logprobs(req: ResponsesRequest) -> bool:
    return LOGPROBS_INCLUDE in (req.include or ()) or bool(req.top_logprobs)


def chat_request(req: ResponsesRequest, turns: list[dict], max_context: int) -> ChatCompletionRequest:
    """The chat request that asks what `req` asks; `turns`: the conversation's
    messages (a stored response's, then conversation_of the input), to which
    the request's own instructions come first (as in OpenAI's API, an earlier
    response's instructions are not carried over)."""
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + turns
    fields = {name: getattr(req, name) for name in _PASSED_ON if getattr(req, name) is not None}
    fields.update(messages=messages, stream=req.stream, max_tokens=req.max_output_tokens,
                  tools=[_chat_tool(i, tool) for i, tool in enumerate(req.tools)] if req.tools else None,
                  tool_choice=_chat_tool_choice(req.tool_choice), response_format=_response_format(req.text),
                  reasoning_effort=req.reasoning.effort if req.reasoning is not None else None,
                  chat_template_kwargs=req.chat_template_kwargs)
    if wants_logprobs(req):
        fields.update(logprobs=True, top_logprobs=req.top_logprobs or 0)
    if req.truncation == "auto":   # keep the prompt's end, with room for the answer
        fields["truncate_prompt_tokens"] = max(max_context - (req.max_output_tokens or 1), 1)
    try:
        return msgspec.convert(fields, ChatCompletionRequest)
    except msgspec.ValidationError as exc:
        raise ApiError(f"invalid request: {exc}") from None


_PASSED_ON = ("model", "temperature", "top_p", "parallel_tool_calls", "top_k", "min_p", "seed", "stop",
              "stop_token_ids", "ignore_eos", "min_tokens", "repetition_penalty", "frequency_penalty",
              "presence_penalty", "logit_bias", "priority", "cache_salt", "mm_processor_kwargs",
              "structured_outputs", "skip_special_tokens", "include_stop_str_in_output")


def conversation_of(given: str | list[dict]) -> list[dict]:
    """Input items as chat messages (see the module's docstring)."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    messages: list[dict] = []
    for i, item in enumerate(given):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise ApiError(f"{where} must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(item, where))
        elif kind == "function_call":
            _join_call(messages, item, where)
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": _text_field(item, "call_id", where),
                             "content": _call_output(item.get("output"), where)})
        elif kind != "reasoning":
            raise ApiError(f"{where}: input items of type {kind!r} are not served here", param="input")
    return messages


def _message(item: dict, where: str) -> dict:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise ApiError(f"{where}.role must be user, assistant, system or developer", param="input")
    content = item.get("content")
    if isinstance(content, list):
        content = [_part(part, f"{where}.content[{j}]") for j, part in enumerate(content)]
        if role == "assistant":   # an earlier answer: its text, as the templates render one
            content = "".join(part["text"] for part in content if part["type"] == "text")
    elif not isinstance(content, str):
        raise ApiError(f"{where}.content must be a string or a list of parts", param="input")
    return {"role": "system" if role == "developer" else role, "content": content}


def _part(part, where: str) -> dict:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in ("input_text", "output_text", "text"):
        return {"type": "text", "text": _text_field(part, "text", where)}
    if kind == "refusal":
        return {"type": "text", "text": _text_field(part, "refusal", where)}
    if kind == "input_image":
        url = part.get("image_url")
        if not isinstance(url, str) or not url:
            raise ApiError(f"{where}: an input_image needs an image_url (file ids are not served here)",
                           param="input")
        return {"type": "image_url", "image_url": {"url": url}}
    if kind in ("image_url", "video_url"):
        return part
    raise ApiError(f"{where}: content parts of type {kind!r} are not served here", param="input")


def _join_call(messages: list[dict], item: dict, where: str) -> None:
    """An earlier answer's function call: a tool call of the assistant
    message it followed (a message of its own if it follows none)."""
    call = {"id": _text_field(item, "call_id", where), "type": "function",
            "function": {"name": _text_field(item, "name", where), "arguments": item.get("arguments") or "{}"}}
    last = messages[-1] if messages else None
    if last is None or last["role"] != "assistant":
        last = {"role": "assistant", "content": ""}
        messages.append(last)
    last.setdefault("tool_calls", []).append(call)


def _call_output(output, where: str) -> str:
    if isinstance(output, str):
        return output
    parts = [_part(part, f"{where}.output") for part in output] if isinstance(output, list) else None
    if parts is None or any(part["type"] != "text" for part in parts):
        raise ApiError(f"{where}.output must be a string or a list of input_text parts", param="input")
    return "".join(part["text"] for part in parts)


def _text_field(item: dict, name: str, where: str) -> str:
    value = item.get(name)
    if not isinstance(value, str):
        raise ApiError(f"{where}.{name} must be a string", param="input")
    return value


def _chat_tool(i: int, tool: dict) -> dict:
    """A Responses function tool (flat) as the chat API's."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise ApiError(f"tools[{i}]: tools of type {kind!r} are not served here (function tools only)",
                       param="tools")
    function = {key: tool[key] for key in ("name", "description", "parameters") if tool.get(key) is not None}
    return {"type": "function", "function": function}


def _chat_tool_choice(choice):
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ApiError('tool_choice must be none, auto, required or {"type": "function", "name": ...}',
                   param="tool_choice")


def _response_format(text: TextConfig | None) -> dict | None:
    fmt = text.format if text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.type == "json_schema":
        if fmt.schema is None:
            raise ApiError("text.format json_schema needs a schema", param="text")
        return {"type": "json_schema", "json_schema": {"name": fmt.name or "answer", "schema": fmt.schema}}
    raise ApiError(f"text.format type {fmt.type!r} is not one of text, json_object, json_schema", param="text")

