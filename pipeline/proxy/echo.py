"""vLLM's `echo`: the answer repeats its input before what the model wrote.

- Text completions: the prompt (its text as sent; a token prompt's decode),
  and with `logprobs` the prompt's tokens first in the logprobs lists: the
  first with none (null), the others with their prompt logprobs, which the
  request then asks for with the same top count (the generator computes
  them in the prefill). This is how evaluation harnesses score a text.
- Chat: the last message, when it is the assistant's (the role of the
  answer), prefixes the answer's content, as vLLM does; with
  continue_final_message this gives the whole message.
Streamed, the echo goes out with the first piece of the answer."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.proxy.logprobs_format import TokenNames


@dataclass(frozen=True)
class Echo:
    text: str
    token_ids: tuple[int, ...] = ()   # a text completion's prompt, whose logprobs lead the lists


def completion_echo(req, prompt: str | list[int], ids: list[int], tokenizer) -> Echo | None:
    if not req.echo:
        return None
    text = prompt if isinstance(prompt, str) else tokenizer.decode(ids, skip_special_tokens=False)
    return Echo(text, tuple(ids))


def chat_echo(req) -> Echo | None:
    if not req.echo:
        return None
    last = req.messages[-1]
    if last.role != "assistant" or last.content is None:
        return Echo("")
    if isinstance(last.content, str):
        return Echo(last.content)
    return Echo("\n".join(part.text for part in last.content if part.type == "text" and part.text is not None))


def echoed_completion_logprobs(name: TokenNames, echo: Echo, prompt_entries, output: dict) -> dict:
    """The completions API's logprobs lists with the prompt's tokens first:
    each prompt token after the first with its logprob and a top dict of it
    and its top k (vLLM's), the output's offsets moved past the prompt's."""
    tokens = [name(t) for t in echo.token_ids]
    offsets, at = [], 0
    for token in tokens:
        offsets.append(at)
        at += len(token)
    tops: list[dict | None] = [None]
    for token, logprob, _, ids, values in prompt_entries:
        top = {name(token): logprob}
        for other, value in zip(ids, values):
            top.setdefault(name(other), value)
        tops.append(top)
    return {"tokens": tokens + output["tokens"],
            "token_logprobs": [None, *(e[1] for e in prompt_entries), *output["token_logprobs"]],
            "top_logprobs": tops + output["top_logprobs"],
            "text_offset": offsets + [o + at for o in output["text_offset"]]}
