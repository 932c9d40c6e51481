"""Structured output requests -> the llguidance grammar the generators
enforce, from any one of the forms clients send:
- `response_format`: OpenAI's `json_object` and `json_schema`;
- `structured_outputs` (vLLM's): `json`, `regex`, `choice`, `grammar` (Lark
  or GBNF) or `json_object`, with its JSON whitespace options;
- vLLM's older `guided_json`, `guided_regex`, `guided_choice`,
  `guided_grammar` and `guided_whitespace_pattern`;
or the grammar of a forced tool_choice (proxy/tools.py). Two forms at once,
or a constraint the grammar compiler refuses, is a 400 naming the field."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass

from pipeline.proxy.api_types import ApiError

_GUIDED = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
           ("guided_grammar", "grammar"))
_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# Where a JSON schema keeps its subschemas.
_ONE_SUBSCHEMA = ("additionalProperties", "items", "contains", "not", "if", "then", "else", "propertyNames",
                  "unevaluatedProperties", "unevaluatedItems")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


@dataclass(frozen=True)
class _Constraint:
    field: str                       # the request field it came from, for errors
    kind: str                        # "json", "regex", "choice" or "grammar"
    value: object
    whitespace_pattern: str | None = None
    closed_objects: bool = False     # disable_additional_properties


def grammar_of(req, tool_grammar: str = "") -> str:
    """The request's grammar, or "" for free text. `tool_grammar`: the one
    that enforces its tool_choice (proxy/tools.py), if any."""
    constraint = _constraint(req)
    if tool_grammar and constraint is not None:
        raise ApiError(f"tool_choice {req.tool_choice!r} already fixes the answer's form; "
                       f"leave {constraint.field} unset", param=constraint.field)
    if tool_grammar:
        return tool_grammar
    if constraint is None:
        return ""
    import llguidance

    grammar = _compile(llguidance, constraint)
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ApiError(f"unsupported {_what(constraint)}: {_reason(error)}", param=constraint.field)
    return grammar


def _constraint(req) -> _Constraint | None:
    found = [c for c in (_from_response_format(req), _from_structured_outputs(req), *_from_guided(req))
             if c is not None]
    if len(found) > 1:
        raise ApiError(f"send one structured output constraint, not {' and '.join(c.field for c in found)}",
                       param=found[1].field)
    return found[0] if found else None


def _from_response_format(req) -> _Constraint | None:
    fmt = req.response_format
    if fmt is None or fmt.get("type") == "text":
        return None
    kind = fmt.get("type")
    if kind == "json_object":
        return _Constraint("response_format", "json", {"type": "object"})
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ApiError("response_format json_schema needs json_schema.schema", param="response_format")
        return _Constraint("response_format", "json", _as_object(spec["schema"], "response_format"))
    raise ApiError(f"response_format type {kind!r} is not one of text, json_object, json_schema",
                   param="response_format")


def _from_structured_outputs(req) -> _Constraint | None:
    spec = getattr(req, "structured_outputs", None)
    if spec is None:
        return None
    field = "structured_outputs"
    given = [k for k in _KINDS if getattr(spec, k) is not None and getattr(spec, k) is not False]
    if len(given) != 1:
        raise ApiError(f"structured_outputs needs exactly one of {', '.join(_KINDS)}; got "
                       f"{', '.join(given) or 'none'}", param=field)
    kind = given[0]
    if kind == "structural_tag":
        raise ApiError("'structured_outputs.structural_tag' is not supported by this server yet; leave it unset",
                       param=field)
    if spec.disable_any_whitespace and spec.whitespace_pattern is not None:
        raise ApiError("structured_outputs: disable_any_whitespace and whitespace_pattern contradict each other",
                       param=field)
    value = {"type": "object"} if kind == "json_object" else getattr(spec, kind)
    kind = "json" if kind == "json_object" else kind
    return _checked(_Constraint(field, kind, value, spec.whitespace_pattern, spec.disable_additional_properties))


def _from_guided(req) -> list[_Constraint | None]:
    pattern = getattr(req, "guided_whitespace_pattern", None)
    found = [_Constraint(name, kind, getattr(req, name), pattern) for name, kind in _GUIDED if getattr(req, name)]
    if pattern is not None and not any(c.kind == "json" for c in found):
        raise ApiError("guided_whitespace_pattern applies to guided_json only", param="guided_whitespace_pattern")
    return [_checked(c) for c in found]


def _checked(c: _Constraint) -> _Constraint:
    """Types msgspec cannot say (a JSON schema's is a string or an object),
    and options that apply to JSON only."""
    if c.kind == "json":
        return _Constraint(c.field, c.kind, _as_object(c.value, c.field), c.whitespace_pattern, c.closed_objects)
    if c.whitespace_pattern is not None:
        raise ApiError(f"{c.field}: whitespace_pattern applies to a JSON schema only", param=c.field)
    if c.kind == "choice" and not c.value:
        raise ApiError(f"{c.field}: choice must be a non-empty list of strings", param=c.field)
    return c


def _compile(llguidance, c: _Constraint) -> str:
    matcher = llguidance.LLMatcher
    try:
        if c.kind == "json":
            schema = _close_objects(c.value) if c.closed_objects else c.value
            # Compact JSON, as OpenAI's own structured output is: with flexible
            # whitespace a weak model can fill its whole budget with newlines.
            # An explicit whitespace_pattern allows that whitespace.
            spacing = ({"whitespace_pattern": c.whitespace_pattern} if c.whitespace_pattern is not None
                       else {"whitespace_flexible": False})
            return matcher.grammar_from_json_schema(schema, overrides=spacing)
        if c.kind == "regex":
            return matcher.grammar_from_regex(c.value)
        if c.kind == "choice":
            # Each choice a Lark string literal: JSON's escapes are Lark's.
            return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(s) for s in c.value))
        return llguidance.grammar_from("grammar", c.value)   # Lark as is; GBNF converted to Lark
    except ValueError as exc:
        raise ApiError(f"invalid {_what(c)}: {exc}", param=c.field) from None


def _close_objects(schema: dict) -> dict:
    """vLLM's disable_additional_properties: every object schema with named
    properties that does not say whether it takes other keys takes none.
    Only subschemas are walked: an `enum` or `const` value, or a property
    that happens to be called "properties", is data and stays as it is."""
    schema = copy.deepcopy(schema)
    stack = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        if ("properties" in node or "patternProperties" in node) and "additionalProperties" not in node:
            node["additionalProperties"] = False
        for key in _ONE_SUBSCHEMA:
            stack.append(node.get(key))
        for key in _SUBSCHEMA_LISTS:
            stack.extend(node.get(key) if isinstance(node.get(key), list) else ())
        for key in _SUBSCHEMA_MAPS:
            stack.extend(node.get(key).values() if isinstance(node.get(key), dict) else ())
    return schema


def _reason(error: str) -> str:
    """llguidance's error in one line: where, and what (its `error:` line,
    as a regex's parse error has one below the caret)."""
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    cause = next((line for line in lines[1:] if line.startswith("error:")), "")
    return f"{lines[0]} {cause}".strip() if lines else error


def _what(c: _Constraint) -> str:
    return {"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}[c.kind]


def _as_object(schema, field: str) -> dict:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ApiError(f"{field} is not valid JSON: {exc}", param=field) from None
    if not isinstance(schema, dict):
        raise ApiError(f"{field} must be a JSON schema object", param=field)
    return schema
