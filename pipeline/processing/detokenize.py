"""Streaming detokenization: token ids in, finished text out, one id at a time.

Decoding each new id alone is wrong for byte-level BPE (a character can span
several tokens) and decoding the whole output each step is O(length). We keep
a small window instead (the prefix-offset / read-offset technique used by
vLLM and TGI): the window starts at a point where the text was complete,
`prefix` is the decode of the window up to the last emitted token, and each
new id costs one decode of the window. Text is emitted only when the window's
decode grows and does not end in U+FFFD, i.e. no character is cut in half.
Decoding the window together with its already-emitted prefix, rather than the
new ids alone, keeps decoders that treat the start of a string specially
(e.g. SentencePiece's leading space) consistent with a full decode.
"""

from __future__ import annotations

from pipeline.processing.tokenizer import Tokenizer

_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's generated ids into text chunks.

    The concatenation of every push() result and the final flush() equals
    tokenizer.decode(all_ids, skip_special_tokens). Not thread-safe; use one per
    request.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._window: list[int] = []  # ids from the prefix offset on
        self._read_offset = 0  # window index after the last emitted id
        self._prefix_text = ""  # decode of window[:read_offset]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one generated id; return the text it completes ("" if none yet)."""
        self._window.append(token_id)
        text = self._decode(self._window)
        if len(text) <= len(self._prefix_text) or text.endswith(_REPLACEMENT_CHAR):
            # Nothing new yet, or a multi-byte character still lacks bytes.
            return ""
        new_text = text[len(self._prefix_text) :]
        # The next window starts after the ids emitted before this step, so the
        # window never holds more than the last emitted chunk plus pending ids.
        self._window = self._window[self._read_offset :]
        self._read_offset = len(self._window)
        self._prefix_text = self._decode(self._window)
        return new_text

    def flush(self) -> str:
        """Return whatever is still held back (possibly ending in U+FFFD) and reset."""
        text = self._decode(self._window)
        remainder = text[len(self._prefix_text) :]
        self._window, self._read_offset, self._prefix_text = [], 0, ""
        return remainder
