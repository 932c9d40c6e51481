"""How a chat template takes a message's content, as vLLM's
`--chat-template-content-format` names it:

- `openai`: content stays a list of parts (`{"type": "text", "text": ...}`,
  `{"type": "image"}`, ...), which the template loops over, writing each
  image's placeholder itself (every vision-language template does);
- `string`: content is one string. A list is flattened: its parts in order,
  a text part's text and an image's or video's placeholder text (what a
  vision template writes for one), joined by newlines, as vLLM joins them
  (vLLM puts every placeholder before the text; here each stays where its
  part was, so the media keep the order the request gave them);
- `auto`: `openai` if the template ever loops over a message's `content`,
  else `string` (vLLM's test, read from the template's syntax tree; here
  it also follows the content into a macro's parameter).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jinja2 import nodes

CONTENT_FORMATS = ("auto", "string", "openai")


def loops_over_content(tree: nodes.Template) -> bool:
    """Whether a `{% for ... in X %}` iterates some message's content: X is
    `m.content` or `m['content']` (maybe through filters), or a name that
    holds one: set from one, or a macro's parameter that a call passes one."""
    holders = _content_holders(tree)
    for loop in tree.find_all(nodes.For):
        target = _unwrapped(loop.iter)
        if _is_content(target) or (isinstance(target, nodes.Name) and target.name in holders):
            return True
    return False


def _unwrapped(node: nodes.Node) -> nodes.Node:
    while isinstance(node, (nodes.Filter, nodes.Test)) and node.node is not None:
        node = node.node
    return node


def _is_content(node: nodes.Node) -> bool:
    node = _unwrapped(node)
    if isinstance(node, nodes.Getattr):
        return node.attr == "content"
    return isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Const) and node.arg.value == "content"


def _content_holders(tree: nodes.Template) -> set[str]:
    names = {a.target.name for a in tree.find_all(nodes.Assign)
             if isinstance(a.target, nodes.Name) and _is_content(a.node)}
    macros = {m.name: [arg.name for arg in m.args] for m in tree.find_all(nodes.Macro)}
    for call in tree.find_all(nodes.Call):
        if isinstance(call.node, nodes.Name) and call.node.name in macros:
            names |= {param for param, arg in zip(macros[call.node.name], call.args) if _is_content(arg)}
    return names


def flattened(messages: Sequence[Mapping[str, Any]], placeholder: Callable[[str], str]) -> list[dict]:
    """Messages with every list content as one string (see the module's
    docstring); `placeholder(kind)`: the text of one "image" or "video"."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            pieces = [part.get("text") or "" if part.get("type") == "text" else placeholder(part["type"])
                      for part in content]
            message = {**message, "content": "\n".join(pieces)}
        out.append(dict(message))
    return out
