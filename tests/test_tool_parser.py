"""The Hermes tool-call parser on crafted model outputs: whole answers, and
streams split at every boundary (hypothesis too) that must add up to the
whole answer; malformed blocks stay content, and nothing raises."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.proxy.tool_parser import END, START, ToolCallStream, header_of, parse_block, parse_tool_calls


def block(name: str, arguments: dict, separators=(", ", ": ")) -> str:
    """A call as the Qwen templates write one."""
    return (f'{START}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": '
            f'{json.dumps(arguments, ensure_ascii=False, separators=separators)}}}\n{END}')


def whole(text: str) -> tuple[str | None, list[tuple[str, str]]]:
    content, calls = parse_tool_calls(text)
    assert all(c.id.startswith("call_") for c in calls) and len({c.id for c in calls}) == len(calls)
    return content, [(c.name, c.arguments) for c in calls]


def streamed(pieces: list[str]) -> tuple[str | None, list[tuple[str, str]]]:
    """What a client that adds up the deltas has at the end (the OpenAI SDK's way)."""
    parser, content, calls = ToolCallStream(), "", {}
    for i, piece in enumerate(pieces):
        text, deltas = parser.feed(piece, last=i == len(pieces) - 1)
        content += text
        for delta in deltas:
            if "id" in delta:   # the first delta of a call: index, id, type, name
                assert delta["index"] == len(calls) and delta["type"] == "function"
                assert delta["id"].startswith("call_")
                calls[delta["index"]] = [delta["function"]["name"], ""]
            calls[delta["index"]][1] += delta["function"]["arguments"]
    assert parser.calls == len(calls)
    return (content or None) if calls else content, [tuple(calls[i]) for i in sorted(calls)]


def splits(text: str):
    """The text in two pieces at every boundary, and one character at a time."""
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text) or [""]


CRAFTED = {
    "text only": ("Just words, no <tool> here.", ("Just words, no <tool> here.", [])),
    "one call": (block("get_weather", {"city": "Paris", "days": 3}),
                 (None, [("get_weather", '{"city": "Paris", "days": 3}')])),
    "text then calls": ("Let me check.\n" + block("a", {"x": [1, {"y": "}"}]}) + "\n" + block("b", {}),
                        ("Let me check.\n\n", [("a", '{"x": [1, {"y": "}"}]}'), ("b", "{}")])),
    "compact JSON and text after": (block("f", {"k": "v"}, (",", ":")) + "\nDone.",
                                    ("\nDone.", [("f", '{"k":"v"}')])),
    "arguments first": (f'{START}{{"arguments": {{"q": "\\u00e9"}}, "name": "s"}}{END}',
                        (None, [("s", '{"q": "é"}')])),
    "escapes and tags in strings": (block('we"ird', {"code": f"print('{START}')", "n": "a\\b"}),
                                    (None, [('we"ird', json.dumps({"code": f"print('{START}')", "n": "a\\b"}))])),
    "unclosed but whole": (f'{START}\n{{"name": "f", "arguments": {{"a": 1}}}}',
                           (None, [("f", '{"a": 1}')])),
    "not JSON": (f"Hi {START}not json{END} bye", (f"Hi {START}not json{END} bye", [])),
    "no arguments object": (f'{START}{{"name": "f", "arguments": "x"}}{END}',
                            (f'{START}{{"name": "f", "arguments": "x"}}{END}', [])),
    "empty name": (f'{START}{{"name": "", "arguments": {{}}}}{END}',
                   (f'{START}{{"name": "", "arguments": {{}}}}{END}', [])),
    "a name that is a lone surrogate": (f'{START}{{"name": "\\ud800", "arguments": {{}}}}{END}',
                                        (f'{START}{{"name": "\\ud800", "arguments": {{}}}}{END}', [])),
    "unclosed start": (f"text {START}\n{{\"na", (f"text {START}\n{{\"na", [])),
    "a tag's beginning at the end": ("almost <tool_ca", ("almost <tool_ca", [])),
    "only newlines between calls": ("\n" + block("f", {}) + "\n\n" + block("g", {}) + "\n",
                                    (None, [("f", "{}"), ("g", "{}")])),
    "whitespace, no calls": ("\n \n", ("\n \n", [])),
    "empty": ("", ("", [])),
    "malformed then good": (f"{START}{{oops}}{END}\n" + block("f", {"a": None}),
                            (f"{START}{{oops}}{END}\n", [("f", '{"a": null}')])),
}


def test_crafted_outputs_whole_and_split_everywhere():
    for name, (text, expected) in CRAFTED.items():
        assert whole(text) == expected, name
        for pieces in splits(text):
            assert streamed(pieces) == expected, (name, pieces)


def test_a_call_streams_its_name_first_then_its_arguments_as_written():
    parser = ToolCallStream()
    text = "Sure." + block("get_weather", {"city": "Oslo"})
    deltas = [parser.feed(ch) for ch in text] + [parser.feed("", last=True)]
    content = "".join(c for c, _ in deltas)
    calls = [d for _, ds in deltas for d in ds]
    assert content == "Sure."
    first = calls[0]
    assert first["function"] == {"name": "get_weather", "arguments": "{"} and first["index"] == 0
    # Before the name was whole, nothing of the call went out; after it, one piece per character.
    assert [d["function"]["arguments"] for d in calls[1:]] == list('"city": "Oslo"}')
    assert all(set(d) == {"index", "function"} and d["index"] == 0 for d in calls[1:])


def test_a_call_that_breaks_after_it_began_stays_the_call_sent_so_far():
    for text, arguments in ((f'{START}\n{{"name": "f", "arguments": {{"a": tru}}}}\n{END}after', '{"a": tru}'),
                            (f'{START}\n{{"name": "f", "arguments": {{"a": 1', '{"a": 1'),
                            (f'{START}\n{{"name": "f", "arguments": {{"a": NaN}}}}\n{END}', '{"a": NaN}'),
                            (f'{START}\n{{"name": "f", "arguments": {{"a": 1 {END} more', '{"a": 1 ')):
        content, calls = whole(text)
        assert calls == [] and content == text            # whole: the raw text, as vLLM does
        for pieces in splits(text):
            got_content, got_calls = streamed(pieces)
            assert got_calls == [("f", arguments)], pieces
            assert START not in (got_content or "")


JSON_LEAF = st.one_of(st.none(), st.booleans(), st.integers(-10**6, 10**6),
                      st.text(st.characters(blacklist_categories=("Cs",)), max_size=8).filter(lambda s: END not in s))
JSON_OBJECT = st.dictionaries(st.text(max_size=5), st.recursive(
    JSON_LEAF, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8), max_size=4)
FREE_TEXT = st.lists(st.sampled_from(list("ab <>/_{}\"\n\\") + ["tool", "call", "<tool_", "</tool_call"]),
                     max_size=8).map("".join).filter(lambda s: START not in s)


@st.composite
def answers(draw):
    """A well-formed answer: free text and calls, and what it must parse to."""
    parts, content, calls = [], "", []
    for _ in range(draw(st.integers(0, 4))):
        text = draw(FREE_TEXT)
        name = draw(st.text(min_size=1, max_size=6).filter(lambda s: END not in s and START not in s))
        arguments = draw(JSON_OBJECT)
        compact = draw(st.booleans())
        parts += [text, block(name, arguments, (",", ":") if compact else (", ", ": "))]
        content += text
        calls.append((name, json.dumps(arguments, ensure_ascii=False,
                                       separators=(",", ":") if compact else (", ", ": "))))
    tail = draw(FREE_TEXT)
    text = "".join(parts) + tail
    content += tail
    expected = (None if calls and not content.strip(" \t\n\r") else content)
    return text, (expected, calls)


@settings(max_examples=300, deadline=None)
@given(answers(), st.data())
def test_streams_add_up_to_the_whole_answer_however_split(answer, data):
    text, expected = answer
    assert whole(text) == expected
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    assert streamed(pieces) == expected


def _broken_after_it_began(text: str) -> bool:
    """Whether some block begins as a call and is not one: the one case a
    stream may differ from the whole answer."""
    pos = 0
    while (start := text.find(START, pos)) >= 0:
        end = text.find(END, start)
        inner = text[start + len(START):len(text) if end < 0 else end]
        if header_of(inner)[0] == "call" and parse_block(inner) is None:
            return True
        pos = len(text) if end < 0 else end + len(END)
    return False


PIECES = st.lists(st.sampled_from([START, END, '{"name": "f", ', '"arguments": ', "{", "}", '"', "\\", "\n", " ",
                                   "x", '{"a": 1}', "<tool", "_call>", "</tool", ":", ","]), max_size=16)


@settings(max_examples=500, deadline=None)
@given(PIECES, st.data())
def test_any_output_parses_without_error_and_streams_the_same_however_split(pieces, data):
    text = "".join(pieces)
    one = streamed([text])
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    assert streamed([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]) == one
    if not _broken_after_it_began(text):
        content, calls = whole(text)
        assert one == ((content or None) if calls else content, calls)


def test_a_block_nested_past_the_recursion_limit_is_no_call_and_no_crash():
    deep = '{"name": "f", "arguments": {"a": ' + "[" * 100_000 + "]" * 100_000 + "}}"
    assert parse_block(deep) is None
    text = f"{START}{deep}{END}"
    assert whole(text) == (text, [])
