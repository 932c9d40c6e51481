"""Token log-probabilities in the OpenAI shapes: chat's `logprobs.content`
list and the completions API's parallel lists. A token is named by its
text, or with vLLM's return_tokens_as_token_ids by `token_id:<id>`, which
tells apart tokens whose text reads alike (each part of a UTF-8 character
reads U+FFFD)."""

from __future__ import annotations

from collections.abc import Callable

# (token id, (its logprob, the top ids, their logprobs)), per output token.
Entry = tuple[int, tuple[float, tuple[int, ...], tuple[float, ...]]]


def entries_of(delta) -> list[Entry]:
    return list(zip(delta.token_ids, delta.logprobs)) if delta.logprobs else []


TokenNames = Callable[[int], str]


def token_names(tokenizer, as_ids: bool = False) -> TokenNames:
    if as_ids:
        return lambda token: f"token_id:{token}"
    return lambda token: tokenizer.decode([token], skip_special_tokens=False)


def chat_logprobs(name: TokenNames, entries: list[Entry]) -> dict:
    def item(token: int, logprob: float) -> dict:
        text = name(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {"content": [{**item(token, logprob), "top_logprobs": [item(t, lp) for t, lp in zip(ids, values)]}
                        for token, (logprob, ids, values) in entries]}


def completion_logprobs(name: TokenNames, entries: list[Entry], offset: int = 0) -> dict:
    """offset: where this piece's text starts in the whole completion (as
    vLLM counts it: the lengths of the tokens' names)."""
    tokens = [name(token) for token, _ in entries]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": [lp for _, (lp, _, _) in entries],
            "top_logprobs": [_top_dict(name, ids, values) for _, (_, ids, values) in entries],
            "text_offset": offsets}


def _top_dict(name: TokenNames, ids: tuple[int, ...], values: tuple[float, ...]) -> dict[str, float]:
    """Keyed by token text, where tokens of a partial UTF-8 character all read
    '\ufffd': the likeliest of those keeps the key."""
    out: dict[str, float] = {}
    for token, value in zip(ids, values):
        out.setdefault(name(token), value)
    return out


def prompt_logprobs(name: TokenNames, entries) -> list[dict | None]:
    """vLLM's prompt_logprobs: None for the first prompt token (nothing comes
    before it), then for each token {id: {"logprob", "rank",
    "decoded_token"}} for it and the top k (ranks 1 .. k)."""
    out: list[dict | None] = [None]
    for token, logprob, rank, ids, values in entries:
        item = {str(token): {"logprob": logprob, "rank": rank, "decoded_token": name(token)}}
        for i, (top, value) in enumerate(zip(ids, values)):
            item.setdefault(str(top), {"logprob": value, "rank": i + 1, "decoded_token": name(top)})
        out.append(item)
    return out
