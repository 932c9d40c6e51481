"""Tool-aware chat templates for the tool-calling tests, and a copy of the
tiny checkpoint that carries one.

These are our own templates, written for these tests. They follow the Hermes
tool format that Qwen's published tool-aware templates use, but their wording
and layout are ours:
- with `tools`, a system turn (the first system message's text, if there is
  one, then our instructions) lists each tool as `tool | tojson`, one per
  line, between `<tools>` and `</tools>`, and asks for calls written as
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`;
- turns are ChatML, `<|im_start|>ROLE\\n...<|im_end|>\\n`, and the generation
  prompt is `<|im_start|>assistant\\n`; with no system message there is no
  system turn;
- an assistant message's `tool_calls` are written as such blocks, one per
  line after its text;
- consecutive `role: "tool"` messages become one user turn of
  `<tool_response>\\n...\\n</tool_response>` blocks.

The constant names say which published format each one stands in for:
QWEN25_TOOLS (text content only; tool-call arguments always through
`tojson`, as Qwen2.5-Instruct's template writes them) and QWEN3_VL_TOOLS
(image and video parts rendered as the tiny checkpoint's own template renders
them; arguments that are already a string written as they are, else
`tojson`, as Qwen3-VL-Instruct's template writes them).
"""

from __future__ import annotations

import shutil
from pathlib import Path

# What the model is told about its tools. Jinja string literals, so "\n" is a
# newline in the output.
_TOOLS_INTRO = (
    r"'## Functions you can call\n\n"
    r"You have access to the functions described below, one JSON object per line:\n'"
)
_TOOLS_OUTRO = (
    r"'\n\nTo call a function, answer with one block per call, each holding the name of"
    r" the function and a JSON object of its arguments, exactly in this form:\n"
    r"<tool_call>\n{\"name\": <name>, \"arguments\": <json object>}\n</tool_call>'"
)

# A message's content as text only: a string as it is, or the text parts of a list.
_TEXT_CONTENT = r"""{%- macro content_of(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- else -%}
        {%- for part in content if part['text'] is defined -%}
            {{- part['text'] -}}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
"""

# A message's content with its image and video parts as placeholders, as the
# tiny checkpoint's template (pipeline/models/tiny_tokenizer.py) writes them.
_VISION_CONTENT = r"""{%- set media = namespace(images=0, videos=0) -%}
{%- macro content_of(content) -%}
    {%- if content is string -%}
        {{- content -}}
    {%- else -%}
        {%- for part in content -%}
            {%- if part['type'] == 'image' or 'image' in part or 'image_url' in part -%}
                {%- set media.images = media.images + 1 -%}
                {%- if add_vision_id -%}
                    {{- 'Picture ' + media.images|string + ': ' -}}
                {%- endif -%}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' -}}
            {%- elif part['type'] == 'video' or 'video' in part -%}
                {%- set media.videos = media.videos + 1 -%}
                {%- if add_vision_id -%}
                    {{- 'Video ' + media.videos|string + ': ' -}}
                {%- endif -%}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' -}}
            {%- elif 'text' in part -%}
                {{- part['text'] -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
"""

# The conversation, given a content_of macro and the expression that writes a
# call's arguments (`fn` is the call's function). Every tag trims the
# template's own whitespace, so only the quoted strings reach the output.
_CONVERSATION = r"""{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if messages[0]['role'] == 'system' -%}
        {{- content_of(messages[0]['content']) + '\n\n' -}}
    {%- endif -%}
    {{- @INTRO@ + '<tools>' -}}
    {%- for tool in tools -%}
        {{- '\n' + (tool | tojson) -}}
    {%- endfor -%}
    {{- '\n</tools>' + @OUTRO@ + '<|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if loop.first and message['role'] == 'system' and tools -%}
        {#- already written, in the turn that lists the tools -#}
    {%- elif message['role'] == 'tool' -%}
        {%- if loop.first or loop.previtem['role'] != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\n<tool_response>\n' + content_of(message['content']) + '\n</tool_response>' -}}
        {%- if loop.last or loop.nextitem['role'] != 'tool' -%}
            {{- '<|im_end|>\n' -}}
        {%- endif -%}
    {%- elif message['role'] == 'assistant' and message['tool_calls'] -%}
        {%- set text = content_of(message['content']) -%}
        {{- '<|im_start|>assistant\n' + text -}}
        {%- for call in message['tool_calls'] -%}
            {%- set fn = call['function'] if call['function'] is defined else call -%}
            {%- if text or not loop.first -%}
                {{- '\n' -}}
            {%- endif -%}
            {{- '<tool_call>\n{"name": "' + fn['name'] + '", "arguments": ' + (@ARGUMENTS@) + '}\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
    {%- else -%}
        {{- '<|im_start|>' + message['role'] + '\n' + content_of(message['content']) + '<|im_end|>\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
{%- endif -%}
"""


def _template(content_macro: str, arguments: str) -> str:
    body = _CONVERSATION.replace("@INTRO@", _TOOLS_INTRO).replace("@OUTRO@", _TOOLS_OUTRO)
    return content_macro + body.replace("@ARGUMENTS@", arguments)


QWEN25_TOOLS = _template(_TEXT_CONTENT, "fn['arguments'] | tojson")

QWEN3_VL_TOOLS = _template(
    _VISION_CONTENT, "fn['arguments'] if fn['arguments'] is string else (fn['arguments'] | tojson)"
)


def with_template(src: Path, dst: Path, template: str) -> Path:
    """A copy of checkpoint `src` at `dst` whose chat template is `template`."""
    shutil.copytree(src, dst)
    (dst / "chat_template.jinja").write_text(template, encoding="utf-8")
    return dst
