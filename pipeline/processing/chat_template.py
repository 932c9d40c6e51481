"""A checkpoint's chat template, loaded and rendered the way transformers does.

Loading follows `from_pretrained`: `chat_template.jinja` (plus named templates
in `additional_chat_templates/`), else `chat_template.json`, else the
`chat_template` entry of `tokenizer_config.json`. Rendering follows
`apply_chat_template(..., tokenize=False)`: the same sandboxed Jinja
environment and helpers, the same message clean-up, and the named special
tokens passed as template variables.
"""

from __future__ import annotations

import functools

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pipeline.processing.content_format import loops_over_content
from pipeline.processing.tokenizer import (
    TOKENIZER_CONFIG_FILE,
    named_special_tokens,
    read_json_file,
    read_tokenizer_config,
)

CHAT_TEMPLATE_FILE = "chat_template.jinja"
LEGACY_CHAT_TEMPLATE_FILE = "chat_template.json"
EXTRA_TEMPLATES_DIR = "additional_chat_templates"

# Message fields that carry reasoning, the first being the one templates read.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _GenerationTag(jinja2.ext.Extension):
    # Some templates wrap assistant turns in {% generation %} for training-time
    # masks; transformers parses the tag, and for plain rendering it is a no-op.
    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: jinja2.runtime.Macro) -> str:
        return caller()


class _TemplateDict:
    # `dict(...)` for templates, without exposing the dict type itself.
    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    # Underscore names are refused so a template cannot reach CPython internals.
    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set the namespace attribute {name!r}"
            )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML characters, which would change prompts.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _make_environment() -> ImmutableSandboxedEnvironment:
    # Chat templates ship with checkpoints and are untrusted code: sandboxed,
    # with exactly the helpers transformers provides.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


def _named_templates(value: Any, origin: Path) -> dict[str, str]:
    if isinstance(value, str):
        return {"default": value}
    # A list of {"name", "template"} entries holds several named templates.
    if isinstance(value, list) and all(isinstance(t, Mapping) for t in value):
        templates = {t.get("name"): t.get("template") for t in value}
        if all(isinstance(k, str) and isinstance(v, str) for k, v in templates.items()):
            return templates
    raise ValueError(f"{origin}: chat_template must be a string or a list of {{name, template}} entries")


def load_chat_templates(model_dir: str | Path) -> tuple[dict[str, str], Path]:
    """Template sources by name ("default", "tool_use", ...) and the file they came from."""
    model_dir = Path(model_dir)
    jinja_path = model_dir / CHAT_TEMPLATE_FILE
    extra_dir = model_dir / EXTRA_TEMPLATES_DIR
    templates: dict[str, str] = {}
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            templates[path.stem] = path.read_text(encoding="utf-8")
    if jinja_path.is_file():
        templates["default"] = jinja_path.read_text(encoding="utf-8")
    if templates:
        return templates, jinja_path if jinja_path.is_file() else extra_dir

    legacy_path = model_dir / LEGACY_CHAT_TEMPLATE_FILE
    legacy = read_json_file(legacy_path, required=False)
    if "chat_template" in legacy:
        return _named_templates(legacy["chat_template"], legacy_path), legacy_path
    config_path = model_dir / TOKENIZER_CONFIG_FILE
    config = read_tokenizer_config(model_dir)
    if config.get("chat_template") is not None:
        return _named_templates(config["chat_template"], config_path), config_path
    raise ValueError(
        f"no chat template in {model_dir}: looked for {CHAT_TEMPLATE_FILE}, {EXTRA_TEMPLATES_DIR}/*.jinja, "
        f"{LEGACY_CHAT_TEMPLATE_FILE} and the chat_template entry of {TOKENIZER_CONFIG_FILE}"
    )


def _plain_data(value: Any) -> Any:
    # A fresh copy built from JSON types only: the caller's messages are never
    # edited, and objects such as decoded images reach the sandbox as inert
    # "<TypeName>" strings (templates only test whether media keys exist).
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {_plain_data(key): _plain_data(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain_data(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain_data(item) for item in value)
    for base in (str, bool, int, float):  # subclasses such as enums: keep the base value only
        if isinstance(value, base):
            return base(value)
    return f"<{type(value).__name__}>"


def _normalize_part(part: Any) -> Any:
    # As the transformers processor does: OpenAI image_url parts become
    # {"type": "image", "url": ...}, the form every VL template understands.
    if isinstance(part, dict) and part.get("type") == "image_url" and "image_url" in part:
        info = part["image_url"]
        return {"type": "image", "url": info.get("url", "") if isinstance(info, dict) else info}
    return part


def _normalize_message(message: Any, index: int) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise TypeError(f"messages[{index}] must be a dict, got {type(message).__name__}")
    # Keys set to None are dropped (OpenAI sends content=None with tool calls);
    # templates handle a missing key but would print "None".
    message = {key: value for key, value in message.items() if value is not None}
    if isinstance(message.get("content"), list):
        message["content"] = [_normalize_part(part) for part in message["content"]]
    reasoning = next((message[key] for key in _REASONING_FIELDS if message.get(key) is not None), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def _cut_after_final_message(text: str, message: Mapping[str, Any]) -> str:
    """The rendered prompt up to the end of the final message's text (its
    last text part), as transformers cuts it: what the template writes after
    it (the end of the turn) goes."""
    final = message.get("content")
    if isinstance(final, list):
        final = next((part.get("text") for part in reversed(final)
                      if isinstance(part, Mapping) and isinstance(part.get("text"), str)), None)
    if not isinstance(final, str) or not final.strip():
        raise ValueError("continue_final_message needs a final message with text to continue")
    for needle in (final, final.strip()):   # a template may strip the text it writes
        at = text.rfind(needle)
        if at >= 0:
            return text[:at + len(needle)]
    raise ValueError("continue_final_message: the chat template does not write the final message's text as given")


def _names_read(tree: nodes.Template) -> frozenset[str]:
    """Every variable, attribute and constant key the template reads."""
    names = {node.name for node in tree.find_all(nodes.Name)}
    names |= {node.attr for node in tree.find_all(nodes.Getattr)}
    names |= {node.arg.value for node in tree.find_all(nodes.Getitem)
              if isinstance(node.arg, nodes.Const) and isinstance(node.arg.value, str)}
    return frozenset(names)


def is_template_text(value: str) -> bool:
    """Whether a --chat-template value is a template itself rather than the
    path of a file holding one (a path has neither braces nor newlines)."""
    return "{" in value or "\n" in value


class ChatTemplate:
    """A checkpoint's compiled chat template(s); render() is safe to call concurrently."""

    def __init__(
        self, templates: Mapping[str, str], special_tokens: Mapping[str, str], origin: str | Path = "<string>"
    ):
        if "default" not in templates:
            raise ValueError(f"{origin}: chat templates {sorted(templates)} include none named 'default'")
        env = _make_environment()
        try:
            self._compiled = {name: env.from_string(source) for name, source in templates.items()}
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise ValueError(f"{origin}: chat template does not compile: {exc}") from exc
        self._sources = dict(templates)
        self._special_tokens = dict(special_tokens)
        trees = {name: env.parse(source) for name, source in templates.items()}
        self._names = {name: _names_read(tree) for name, tree in trees.items()}
        self._takes_parts = {name: loops_over_content(tree) for name, tree in trees.items()}

    def replaced(self, source: str) -> ChatTemplate:
        """A template compiled from `source` with this one's special tokens (a
        request's own, as vLLM takes one with --trust-request-chat-template).
        The last few are kept compiled: a client sends the same one again."""
        return _replaced(source, tuple(sorted(self._special_tokens.items())))

    @classmethod
    def from_checkpoint(cls, model_dir: str | Path, override: str | None = None) -> ChatTemplate:
        """`override`: a template (its Jinja source) used instead of the
        checkpoint's own, as `vllm serve --chat-template` takes one."""
        model_dir = Path(model_dir)
        if override is not None:
            templates, origin = {"default": override}, "--chat-template"
        else:
            templates, origin = load_chat_templates(model_dir)
        config = read_tokenizer_config(model_dir)
        special_tokens = named_special_tokens(config, model_dir / TOKENIZER_CONFIG_FILE)
        return cls(templates, special_tokens, origin)

    @property
    def source(self) -> str:
        """The default template's Jinja source."""
        return self._sources["default"]

    def reads(self, name: str, *, tools: bool = False) -> bool:
        """Whether the template that renders a conversation (with tools, or
        not) ever reads `name`, as a variable or a field (`tools`,
        `tool_calls`, ...): if it never does, what it names is lost."""
        return name in self._names[self._pick([{}] if tools else None)]

    def content_format(self, *, tools: bool = False) -> str:
        """`openai` if the template that renders a conversation (with tools,
        or not) loops over a message's content parts, else `string`
        (content_format.py: what `--chat-template-content-format auto` picks)."""
        return "openai" if self._takes_parts[self._pick([{}] if tools else None)] else "string"

    def _pick(self, tools: Sequence[Mapping] | None) -> str:
        if tools is not None and "tool_use" in self._compiled:
            return "tool_use"
        return "default"

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        continue_final_message: bool = False,
        **template_kwargs: Any,
    ) -> str:
        """Render OpenAI-style messages to the prompt string.

        Extra keyword arguments (e.g. add_vision_id=True) become template
        variables and override the special tokens of the same name.
        `continue_final_message` (transformers' and vLLM's): the prompt ends
        where the final message's text does, without the end of its turn, so
        the model goes on writing that message (a prefilled answer); it
        needs add_generation_prompt off. Raises ValueError for an empty
        conversation or a final message the prompt does not end with, and
        jinja2.TemplateError when the template rejects the messages
        (raise_exception).
        """
        if not messages:
            raise ValueError("cannot render an empty conversation: give at least one message")
        if tools is not None and not all(isinstance(tool, Mapping) for tool in tools):
            raise TypeError("tools must be JSON-schema dicts")
        if documents is not None and not all(isinstance(doc, Mapping) for doc in documents):
            raise TypeError("documents must be dicts with 'title' and 'text' keys")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be set")
        chat = [_normalize_message(message, i) for i, message in enumerate(messages)]
        variables = _plain_data({**self._special_tokens, **template_kwargs})
        text = self._compiled[self._pick(tools)].render(
            messages=_plain_data(chat),
            tools=_plain_data(tools),
            documents=_plain_data(documents),
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
        return _cut_after_final_message(text, chat[-1]) if continue_final_message else text


@functools.lru_cache(maxsize=16)
def _replaced(source: str, special_tokens: tuple[tuple[str, str], ...]) -> ChatTemplate:
    return ChatTemplate({"default": source}, dict(special_tokens), "the request's chat_template")
