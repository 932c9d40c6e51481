"""A chat request's `tools`, `tool_choice` and `parallel_tool_calls`: checked
(a 400 naming the field otherwise), as the chat template's `tools`, and as
the grammar that enforces tool_choice "required" or a named function.

The grammar holds the output to the Hermes format that tool-aware chat templates teach,
as the template writes a call, so the model is asked for what it was trained
on: `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`, the
arguments following that tool's `parameters` schema, with the separators of
the template's `tojson` (", " and ": "). "required": one or more calls (one
with parallel_tool_calls false), separated by a newline; a named function:
exactly one call of it. Where the tokenizer has `<tool_call>` and
`</tool_call>` as tokens of their own (real checkpoints' do), the grammar names those
tokens; where it has not (the tiny test tokenizer), it spells the tags out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pipeline.proxy.api_types import ApiError
from pipeline.proxy.tool_parser import END, START

CHOICES = ("none", "auto", "required")
# The JSON of the arguments as the chat templates' `tojson` writes it.
_ARGUMENT_STYLE = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolRequest:
    tools: tuple[dict, ...] = ()     # as the client sent them: the chat template's `tools`
    names: tuple[str, ...] = ()
    parameters: tuple[dict, ...] = ()   # each tool's arguments schema
    choice: str = "none"             # none, auto, required, or named
    named: str | None = None         # the function tool_choice names
    parallel: bool = True

    @property
    def forced(self) -> bool:
        """Whether a grammar holds the answer to tool calls."""
        return self.choice in ("required", "named")

    @property
    def parses(self) -> bool:
        """Whether the answer's tool calls are parsed out of its text."""
        return bool(self.tools) and self.choice != "none"

    @property
    def template_tools(self) -> list[dict] | None:
        return list(self.tools) or None


def tool_request(req) -> ToolRequest:
    """The request's tool fields, checked (`tool_choice` and
    `parallel_tool_calls` may be absent: /tokenize takes only tools)."""
    names, parameters = [], []
    for i, tool in enumerate(req.tools or ()):
        name, schema = _function_of(i, tool)
        if name in names:
            raise ApiError(f"tools[{i}]: a second function named {name!r}", param="tools")
        names.append(name)
        parameters.append(schema)
    choice, named = _choice_of(getattr(req, "tool_choice", None), bool(names))
    if named is not None and named not in names:
        raise ApiError(f"tool_choice names the function {named!r}, which is not among the tools",
                       param="tool_choice")
    parallel = getattr(req, "parallel_tool_calls", None)
    parallel = True if parallel is None else parallel
    return ToolRequest(tuple(req.tools or ()), tuple(names), tuple(parameters), choice, named, parallel)


def _function_of(i: int, tool) -> tuple[str, dict]:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise ApiError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}", param="tools")
    function = tool.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise ApiError(f"tools[{i}].function needs a non-empty name", param="tools")
    schema = function.get("parameters")
    if schema is not None and not isinstance(schema, dict):
        raise ApiError(f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
    if function.get("description") is not None and not isinstance(function["description"], str):
        raise ApiError(f"tools[{i}].function.description must be a string", param="tools")
    return function["name"], schema if schema is not None else _NO_PARAMETERS


def _choice_of(value, have_tools: bool) -> tuple[str, str | None]:
    if value is None:
        return ("auto" if have_tools else "none"), None
    if isinstance(value, str):
        if value not in CHOICES:
            raise ApiError(f"tool_choice must be one of {', '.join(CHOICES)} or a named function, got {value!r}",
                           param="tool_choice")
        choice, named = value, None
    else:
        function = value.get("function") if value.get("type") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ApiError('a named tool_choice is {"type": "function", "function": {"name": ...}}',
                           param="tool_choice")
        choice, named = "named", function["name"]
    if not have_tools and choice in ("required", "named"):
        raise ApiError(f"tool_choice {value!r} needs tools", param="tool_choice")
    return (choice if have_tools else "none"), named


def template_tool_calls(calls, where: str) -> list[dict]:
    """An assistant message's tool_calls as the templates read them: the
    arguments as an object (the API sends a JSON string), as vLLM and
    transformers hand them over."""
    out = []
    for j, call in enumerate(calls):
        arguments = call.function.arguments
        if isinstance(arguments, str) and arguments.strip():
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError as exc:
                raise ApiError(f"{where}.tool_calls[{j}].function.arguments is not valid JSON: {exc}",
                               param="messages") from None
        elif not arguments:
            arguments = {}
        entry = {"type": call.type, "function": {"name": call.function.name, "arguments": arguments}}
        out.append({"id": call.id, **entry} if call.id is not None else entry)
    return out


def tag_tokens_of(tokenizer) -> frozenset[str]:
    """The tool-call tags the tokenizer has as added tokens of their own (as
    real checkpoints' do). llguidance reads every added token as a special one, which a
    plain-text literal never matches: the grammar must name these as tokens."""
    added = tokenizer.added_tokens()
    return frozenset(tag for tag in (START, END) if tag in added)


def forced_grammar(tools: ToolRequest, tag_tokens: frozenset[str] = frozenset()) -> str:
    """The llguidance grammar for tool_choice "required" or a named
    function; "" for the other choices. `tag_tokens`: tag_tokens_of the
    model's tokenizer."""
    if not tools.forced:
        return ""
    import llguidance

    def tag(text: str) -> str:
        return text if text in tag_tokens else _lark(text)

    picked = [i for i, name in enumerate(tools.names) if tools.choice == "required" or name == tools.named]
    lines = ["start: call" + (' ("\\n" call)*' if tools.choice == "required" and tools.parallel else ""),
             f"call: {tag(START)} " + _lark('\n{"name": ') + " (" + " | ".join(f"f{i}" for i in picked) + ") "
             + _lark("}\n") + f" {tag(END)}"]
    for i in picked:
        name = json.dumps(tools.names[i], ensure_ascii=False)
        schema = json.dumps({**tools.parameters[i], "x-guidance": _ARGUMENT_STYLE})
        lines.append(f"f{i}: " + _lark(name + ', "arguments": ') + " %json " + schema)
    grammar = llguidance.LLMatcher.grammar_from_lark("\n".join(lines))
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ApiError(f"cannot enforce tool_choice with these tools' parameters: {error.splitlines()[0]}",
                       param="tools")
    return grammar


def _lark(text: str) -> str:
    """`text` as a Lark string literal."""
    return json.dumps(text)
