"""Structured output requests -> the llguidance grammar the generators
enforce: `response_format` (`json_object`, `json_schema`) and the common
servers' `guided_json`, or the grammar of a forced tool_choice
(proxy/tools.py). A schema the grammar compiler refuses is a 400."""

from __future__ import annotations

import json

from pipeline.proxy.api_types import ApiError


def grammar_of(req, tool_grammar: str = "") -> str:
    """The request's grammar, or "" for free text. `tool_grammar`: the one
    that enforces its tool_choice (proxy/tools.py), if any."""
    schema, field = _schema(req)
    if tool_grammar and schema is not None:
        raise ApiError(f"tool_choice {req.tool_choice!r} already fixes the answer's form; leave {field} unset",
                       param=field)
    if tool_grammar:
        return tool_grammar
    if schema is None:
        return ""
    import llguidance

    try:
        # Compact JSON, as OpenAI's own structured output is: with flexible
        # whitespace a weak model can fill its whole budget with newlines.
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides={"whitespace_flexible": False})
    except ValueError as exc:
        raise ApiError(f"invalid JSON schema: {exc}", param=field) from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ApiError(f"unsupported JSON schema: {error.splitlines()[0]}", param=field)
    return grammar


def _schema(req) -> tuple[dict | None, str]:
    fmt, guided = req.response_format, req.guided_json
    if fmt is not None and guided:
        raise ApiError("send one of response_format and guided_json", param="guided_json")
    if guided:
        return _as_object(guided, "guided_json"), "guided_json"
    if fmt is None or fmt.get("type") == "text":
        return None, "response_format"
    kind = fmt.get("type")
    if kind == "json_object":
        return {"type": "object"}, "response_format"
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ApiError("response_format json_schema needs json_schema.schema", param="response_format")
        return _as_object(spec["schema"], "response_format"), "response_format"
    raise ApiError(f"response_format type {kind!r} is not one of text, json_object, json_schema",
                   param="response_format")


def _as_object(schema, field: str) -> dict:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ApiError(f"{field} is not valid JSON: {exc}", param=field) from None
    if not isinstance(schema, dict):
        raise ApiError(f"{field} must be a JSON schema object", param=field)
    return schema
