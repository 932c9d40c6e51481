"""A request's sampling settings and the checks on their values: plain data,
no torch, so the proxy refuses a bad value with a 400 at once and the
generator's engine checks the same rules again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

# The most top logprobs a token may ask for by default (the OpenAI API's own
# cap, and vLLM's --max-logprobs default); a server's --max-logprobs may raise it.
MAX_TOP_LOGPROBS = 20
MAX_SEED = 2**64 - 1   # what a seed's generator and the wire's msgpack ints hold


def check_int(name: str, value: object, minimum: int) -> None:
    # bool is an int subclass; a True max_tokens is a caller bug, not 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def check_number(name: str, value: object, low: float, high: float, low_open: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value > high or value < low or (low_open and value == low):
        bound = f"({low:g}, {high:g}]" if low_open else f"[{low:g}, {high:g}]"
        raise ValueError(f"{name} must be a number in {bound}, got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    min_tokens: int = 0
    temperature: float = 0.0          # 0 means greedy
    top_k: int = 0                    # 0 means no top-k cut
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()        # stop strings, matched by the detokenizer
    ignore_eos: bool = False
    repetition_penalty: float = 1.0   # 1 means off (engine/penalties.py says what each does)
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()   # (token id, added to its logit)
    logprobs: int | None = None       # None: none; k: the chosen token's and the top k (engine/logprobs.py)
    grammar: str = ""                 # llguidance's grammar the output must follow (engine/grammar.py)
    allowed_token_ids: tuple[int, ...] = ()   # (): any; else every other token is cut (engine/sampler.py)
    include_stop_str_in_output: bool = False  # the stop string, or the stop token's text, ends the text
    skip_special_tokens: bool = True          # special tokens' text left out (the detokenizer's option)
    prompt_logprobs: int | None = None        # None: none; k: each prompt token's and the top k (engine/prompt_logprobs.py)
    # vLLM's bad_words as token sequences: the last token of one is banned
    # where the output ends with the others (a one-token word: always).
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        check_int("max_tokens", self.max_tokens, 1)
        check_int("min_tokens", self.min_tokens, 0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        check_int("top_k", self.top_k, 0)
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None:
            check_int("seed", self.seed, 0)
            if self.seed > MAX_SEED:
                raise ValueError(f"seed must be at most {MAX_SEED} (2**64 - 1), got {self.seed}")
        # Lists are accepted for convenience; stored as tuples so the object stays hashable.
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", tuple(self.stop))
        for token in self.stop_token_ids:
            check_int("stop_token_ids[...]", token, 0)
        for text in self.stop:
            if not isinstance(text, str) or not text:
                raise ValueError(f"stop strings must be non-empty str, got {text!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        self._check_processors()

    def _check_processors(self) -> None:
        check_number("repetition_penalty", self.repetition_penalty, 0.0, 2.0 ** 31, low_open=True)
        check_number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        check_number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        check_number("min_p", self.min_p, 0.0, 1.0)
        object.__setattr__(self, "logit_bias", tuple((t, float(b)) for t, b in self.logit_bias))
        for token, bias in self.logit_bias:
            check_int("logit_bias token id", token, 0)
            check_number(f"logit_bias[{token}]", bias, -100.0, 100.0)
        object.__setattr__(self, "bad_words_token_ids", tuple(tuple(w) for w in self.bad_words_token_ids))
        for word in self.bad_words_token_ids:
            if not word:
                raise ValueError("a bad word must be at least one token")
            for token in word:
                check_int("bad_words_token_ids[...]", token, 0)
        for token in self.allowed_token_ids:
            check_int("allowed_token_ids[...]", token, 0)
        object.__setattr__(self, "allowed_token_ids", tuple(sorted(set(self.allowed_token_ids))))
        for name in ("include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.grammar, str):
            raise ValueError(f"grammar must be a str, got {type(self.grammar).__name__}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), 0)   # the most: the server's (check_logprobs)


def max_logprobs_of(flag: int, vocab_size: int) -> int:
    """--max-logprobs N as a cap: -1 is the whole vocabulary, as in vLLM."""
    if flag == -1:
        return vocab_size
    if flag < 0:
        raise ValueError(f"--max-logprobs must be -1 (the whole vocabulary) or at least 0, got {flag}")
    return flag


def check_logprobs(params: SamplingParams, max_logprobs: int) -> None:
    """ValueError (a 400) for more top logprobs than the server gives (--max-logprobs)."""
    for name, kind in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
        asked = getattr(params, name)
        if asked is not None and asked > max_logprobs:
            raise ValueError(f"Requested {kind} logprobs of {asked}, which is greater than max allowed: "
                             f"{max_logprobs} (the server's --max-logprobs)")
