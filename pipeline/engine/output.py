"""From sampled token ids to what a client sees: text deltas, stop strings,
finish reasons.

Stop strings are found in the detokenized text. Text that could still become
the start of a stop string is held back, so a client never receives part of
a stop string; when one matches, the output is cut before it and the request
is finished with reason "stop". With vLLM's include_stop_str_in_output the
cut comes after it instead, and nothing is held back: a stop string's
beginning is part of the text whether or not the rest follows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.processing.detokenize import IncrementalDetokenizer
from pipeline.processing.tokenizer import Tokenizer


@dataclass(frozen=True)
class RequestOutput:
    """What changed for one request in one step."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_text: str
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None
    num_cached_tokens: int = 0   # on the last: prompt tokens the prefix cache held
    logprobs: tuple = ()   # engine/logprobs.py's TokenLogprobs per new token, when asked for
    stop_reason: str | int | None = None   # on the last, as vLLM: the stop string or stop token id that ended it
    phases: tuple[float, ...] = ()   # on the last: (queue, prefill, decode) seconds (engine/request_phases.py)
    prompt_logprobs: tuple = ()   # on the first, when asked: engine/prompt_logprobs.py's entries, in prompt order


@dataclass(frozen=True)
class Resumed:
    """A request moved here from a generator that was lost: the tokens it
    had produced there (the tail of its prompt here), and how many
    characters of their text its client has. Its text, stop strings,
    grammar and penalties go on from those tokens, as if it had never moved."""

    token_ids: tuple[int, ...]
    text_sent: int


@dataclass
class TextState:
    """One request's text so far and the part not yet sent."""

    detokenizer: IncrementalDetokenizer
    stop: tuple[str, ...]
    min_tokens: int = 0   # stop strings count only once this many tokens are out (as vLLM)
    include_stop: bool = False   # include_stop_str_in_output
    text: str = ""
    sent: int = 0
    stopped: bool = False
    stop_string: str | None = None   # the one that matched, once stopped
    token_ids: list[int] = field(default_factory=list)

    @classmethod
    def create(cls, tokenizer: Tokenizer, stop: tuple[str, ...], min_tokens: int = 0, include_stop: bool = False,
               skip_special_tokens: bool = True) -> TextState:
        return cls(IncrementalDetokenizer(tokenizer, skip_special_tokens), stop, min_tokens, include_stop)

    @classmethod
    def resume(cls, tokenizer: Tokenizer, stop: tuple[str, ...], min_tokens: int, resumed: Resumed,
               include_stop: bool = False, skip_special_tokens: bool = True) -> TextState:
        """The state the lost generator had: the text of the earlier tokens,
        of which only what the client lacks (held back there: part of a
        character, or what could begin a stop string) is still to be sent,
        and where a stop string may begin. `min_tokens` counts from here,
        as the moved request's sampling does."""
        state = cls.create(tokenizer, stop, min_tokens + len(resumed.token_ids), include_stop, skip_special_tokens)
        for token_id in resumed.token_ids:
            state.token_ids.append(token_id)
            state.text += state.detokenizer.push(token_id)
        state.sent = min(resumed.text_sent, len(state.text))
        return state

    @classmethod
    def of(cls, tokenizer: Tokenizer, params, resumed: Resumed | None = None) -> TextState:
        """A request's text state from its SamplingParams: a new one, or the
        one it had where it ran before it moved here."""
        options = (params.include_stop_str_in_output, params.skip_special_tokens)
        if resumed is None:
            return cls.create(tokenizer, params.stop, params.min_tokens, *options)
        return cls.resume(tokenizer, params.stop, params.min_tokens, resumed, *options)

    def push(self, token_id: int) -> str:
        """Add a token; the text that may be sent now. Sets `stopped` when a
        stop string appeared (the text is then cut before it)."""
        self.token_ids.append(token_id)
        self.text += self.detokenizer.push(token_id)
        return self._release(final=False)

    def finish(self) -> str:
        """The rest of the text at the end of the request."""
        if not self.stopped:
            self.text += self.detokenizer.flush()
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stop and not self.stopped and len(self.token_ids) >= self.min_tokens:
            # Search only where a new match can start.
            start = max(0, self.sent - max(len(s) for s in self.stop) + 1)
            hits = [(at, s) for at, s in ((self.text.find(s, start), s) for s in self.stop) if at >= 0]
            if hits:
                at, self.stop_string = min(hits)
                self.text = self.text[:at + len(self.stop_string) if self.include_stop else at]
                self.stopped = True
        limit = len(self.text)
        if self.stop and not self.stopped and not final and not self.include_stop:
            limit -= _partial_stop_suffix(self.text, self.stop)
        if limit <= self.sent:
            return ""
        delta = self.text[self.sent:limit]
        self.sent = limit
        return delta


def _partial_stop_suffix(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that begins some stop string."""
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if stop.startswith(text[-k:]):
                longest = k
                break
    return longest
