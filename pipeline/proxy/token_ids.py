"""vLLM's `return_token_ids` (chat and text completions): the answer
carries the token ids of its prompt and of each choice, so that a client
(an RL trainer, say) need not tokenize the text again.

Where they go, as vLLM puts them:
- whole: each choice's `token_ids`; the prompt's `prompt_token_ids` once at
  the top of a chat response (its choices share the prompt), per choice on
  a text completion (a batch's choices have prompts of their own);
- streamed: each chunk's choice carries the `token_ids` since its last
  chunk (a piece whose text is held back sends none of its own); the
  prompt's ids come with each choice's first chunk (chat: at the chunk's
  top, on the role chunk; text completion: in the choice).

A choice's ids are those its usage counts (`completion_tokens`), whichever
generators made them; the prompt's are the rendered prompt's, without the
tokens a moved request carried on to its next generator.
"""

from __future__ import annotations

from pipeline.proxy.flights import Flight, Work


def prompt_ids(flight: Flight) -> list[int]:
    ids = flight.work.request.prompt_token_ids
    return list(ids[:len(ids) - flight.resumed_from])


def add_to_whole(body: dict, flights: list[Flight], chat: bool) -> dict:
    """A whole response's choices (in the order of `flights`) and prompt."""
    if not flights[0].work.return_token_ids:
        return body
    for choice, flight in zip(body["choices"], flights):
        choice["token_ids"] = list(flight.token_ids)
        if not chat:
            choice["prompt_token_ids"] = prompt_ids(flight)
    if chat:
        body["prompt_token_ids"] = prompt_ids(flights[0])
    return body


def add_to_role_chunk(chunk: dict, work: Work) -> dict:
    """A chat stream's role chunk of one choice: the prompt's ids."""
    if work.return_token_ids:
        chunk["prompt_token_ids"] = list(work.request.prompt_token_ids)
    return chunk


class StreamedIds:
    """One streamed choice's ids. A piece whose text is held back (part of
    a character, a stop string that may be forming) sends no chunk; its ids
    go with the next chunk that is sent, so that the chunks' ids add up to
    the choice's."""

    def __init__(self, flight: Flight, chat: bool) -> None:
        self.flight, self.chat = flight, chat
        self.on = flight.work.return_token_ids
        self.pending: list[int] = []
        self.first = True

    def hold(self, token_ids) -> None:
        if self.on:
            self.pending += token_ids

    def attach(self, chunk: dict) -> dict:
        """The chunk about to be sent, with the ids held so far (and a text
        completion's prompt with its first chunk)."""
        if self.on:
            choice = chunk["choices"][0]
            choice["token_ids"], self.pending = self.pending, []
            if self.first and not self.chat:
                choice["prompt_token_ids"] = prompt_ids(self.flight)
            self.first = False
        return chunk
