"""vLLM's reasoning parsers (`--reasoning-parser`): a thinking model's answer
split into its reasoning, written between `<think>` and `</think>`, and its
content, the text after `</think>`.

As vLLM's parsers of the same names (the text decides, so a stream and a
whole answer split alike):
- a `<think>` that opens the answer (after any whitespace) is dropped: some
  chat templates write it into the prompt, some models write it themselves
  (vLLM's drops the text up to a `<think>` anywhere; here a later one stays
  in the reasoning, as written);
- the reasoning runs to the first `</think>`, the content is the rest (None
  if empty);
- with no `</think>`, the whole answer is reasoning (the model was cut off
  while thinking);
- an answer whose prompt has already closed the reasoning (some templates
  write `<think>\\n\\n</think>` into the prompt when thinking is off) is all
  content; so is, under a parser whose format names the template variable
  that turns thinking off (pipeline/models/reasoning_parsers.py), one whose
  request set it false (`chat_template_kwargs: {"enable_thinking": false}`),
  whatever its template wrote. (vLLM's parser still splits such an answer
  at a `</think>` it writes; here it stays in the content.)

With a grammar (structured output, or a forced tool_choice) vLLM holds only
the content to it, not the reasoning: `grammar_after_reasoning` lets any
token through until `</think>` (the end token, which the tokenizer must have
as one token of its own), then the request's grammar.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pipeline.models.reasoning_parsers import REASONING_PARSERS

PARSERS = tuple(REASONING_PARSERS)
START, END = "<think>", "</think>"
WHITESPACE = " \t\n\r"


@dataclass(frozen=True)
class ReasoningParser:
    """One of PARSERS, bound to the model's tokenizer."""

    off_variable: str | None   # the template variable whose false turns thinking off, if any
    start_id: int
    end_id: int
    special_ids: frozenset[int]   # the tokenizer's special tokens: where a prompt scan stops

    def for_request(self, prompt_ids, template_kwargs: dict | None, include: bool = True) -> ReasoningSplit:
        """How one request's answer splits: its prompt may already have closed
        the reasoning. include: vLLM's include_reasoning."""
        thinking_off = self.off_variable is not None and (template_kwargs or {}).get(self.off_variable) is False
        return ReasoningSplit(self.end_id, self._prompt_closed(prompt_ids), thinking_off, include)

    def _prompt_closed(self, prompt_ids) -> bool:
        """Whether the prompt ends in a closed reasoning: scanning back from
        its end, `</think>` comes before `<think>` and before any special token
        (the one opening the assistant's turn, say), so reasoning in earlier
        turns does not count."""
        for token in reversed(prompt_ids):
            if token == self.end_id:
                return True
            if token == self.start_id or token in self.special_ids:
                return False
        return False


def reasoning_parser(name: str | None, tokenizer) -> ReasoningParser | None:
    """The parser `--reasoning-parser NAME` asks for (None: none); a
    ValueError, in one line, for an unknown name or a tokenizer without the
    tags as tokens of their own (vLLM refuses to start then too)."""
    if name is None:
        return None
    if name not in PARSERS:
        raise ValueError(f"--reasoning-parser {name}: want one of {', '.join(PARSERS)}")
    added = tokenizer.added_tokens()
    missing = [tag for tag in (START, END) if tag not in added]
    if missing:
        raise ValueError(f"--reasoning-parser {name}: this model's tokenizer has no {' or '.join(missing)} "
                         "token; it is not a thinking model")
    (start, _), (end, _) = added[START], added[END]
    special = frozenset(token_id for token_id, is_special in added.values() if is_special)
    return ReasoningParser(REASONING_PARSERS[name].off_variable, start, end, special - {start, end})


@dataclass(frozen=True)
class ReasoningSplit:
    """How one request's answer splits into reasoning and content."""

    end_id: int
    prompt_closed: bool = False   # the prompt already ended the reasoning: all is content
    thinking_off: bool = False    # the request set its parser's off_variable false
    include: bool = True          # vLLM's include_reasoning: false drops the reasoning from the answer

    @property
    def all_content(self) -> bool:
        return self.prompt_closed or self.thinking_off

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole answer's (reasoning, content)."""
        if self.all_content:
            return None, text
        body = _after_start(text)
        reasoning, end, content = body.partition(END)
        if not end:
            return body, None
        return reasoning, content or None

    def grammar(self, grammar: str) -> str:
        """The grammar a request with this split is held to (see the module's docstring)."""
        if not grammar or self.all_content:
            return grammar
        return grammar_after_reasoning(grammar, self.end_id)


def _after_start(text: str) -> str:
    """The text without a `<think>` that opens it."""
    stripped = text.lstrip(WHITESPACE)
    return stripped[len(START):] if stripped.startswith(START) else text


def grammar_after_reasoning(grammar: str, end_id: int) -> str:
    """llguidance's grammar (the JSON of grammar_from_*): any tokens but
    `end_id`, then optionally `end_id` and `grammar`. The answer may end while
    it reasons (as without a grammar); once `end_id` is written, the rest must
    follow `grammar` to its end."""
    outer = _as_grammar_list(grammar)
    inner = outer["grammars"]
    name = inner[0].get("name") or "answer"
    inner[0] = {**inner[0], "name": name}
    wrapper = {"name": "reasoning", "lark_grammar": f"start: <[^{end_id}]>* (<[{end_id}]> @{name})?"}
    return json.dumps({**outer, "grammars": [wrapper, *inner]})


def _as_grammar_list(grammar: str) -> dict:
    """llguidance's grammar as its JSON form: grammar_from_lark and
    grammar_from give the Lark text itself, the others the JSON."""
    try:
        found = json.loads(grammar)
    except json.JSONDecodeError:
        found = None
    if isinstance(found, dict) and isinstance(found.get("grammars"), list) and found["grammars"]:
        return found
    return {"grammars": [{"name": "answer", "lark_grammar": grammar}]}


class ReasoningStream:
    """One streamed answer split as `ReasoningSplit.split` splits it whole:
    each piece of text in, its (reasoning, content) parts out. Only what may
    still turn out to be an opening `<think>` or the start of `</think>` is
    held back, until the next piece (or the last) decides it."""

    def __init__(self, split: ReasoningSplit) -> None:
        self._held = ""
        self._opened = split.all_content   # past a possible opening <think>
        self._closed = split.all_content   # past </think>: the rest is content

    def feed(self, text: str, last: bool) -> tuple[str, str]:
        """(reasoning, content) to send for this piece; either may be ""."""
        text, self._held = self._held + text, ""
        if self._closed:
            return "", text
        if not self._opened:
            text = self._open(text, last)
            if not self._opened:
                return "", ""
        reasoning, end, content = text.partition(END)
        if end:
            self._closed = True
            return reasoning, content
        if not last:
            keep = _tag_prefix_at_end(text, END)
            text, self._held = text[:len(text) - keep], text[len(text) - keep:]
        return text, ""

    def _open(self, text: str, last: bool) -> str:
        """Past the answer's start: drop an opening <think>; hold the start
        while it may still be one (whitespace, then part of the tag)."""
        stripped = text.lstrip(WHITESPACE)
        if stripped.startswith(START):
            self._opened = True
            return stripped[len(START):]
        if not last and START.startswith(stripped):
            self._held = text
            return ""
        self._opened = True
        return text


def _tag_prefix_at_end(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0
