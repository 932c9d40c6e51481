"""One log line per finished request: its id (the X-Request-Id value), how
it ended, its tokens, and where its time went (time to first token and end
to end, from its arrival here; queued, prefill and decode, at its generator),
with the same as JSON fields under --log-format json (pipeline/logs.py)."""

from __future__ import annotations

import logging

from pipeline import protocol
from pipeline.logs import REQUESTS_LOGGER

log = logging.getLogger(REQUESTS_LOGGER)


def _fields(flight, status: str, now: float) -> dict:
    work = flight.work
    fields = {"request_id": work.client_id or work.request.request_id, "internal_id": work.request.request_id,
              "status": status, "completion_tokens": flight.tokens, "e2e_s": round(now - flight.created, 4),
              "generator": flight.generator, "attempts": flight.attempt + 1}
    if flight.first_token_at is not None:
        fields["ttft_s"] = round(flight.first_token_at - flight.created, 4)
    return fields


def log_aborted(flight, now: float) -> None:
    """A request whose client hung up before its end: it was stopped at its generator."""
    fields = _fields(flight, "aborted", now)
    text = " ".join(f"{k}={v}" for k, v in fields.items() if k != "request_id")
    log.info(f"request {fields['request_id']} aborted (the client hung up): {text}", extra={"fields": fields})


def log_finished(flight, delta: protocol.TokenDelta, now: float) -> None:
    """`flight`: the dispatcher's Flight of the request, `now` its end (time.monotonic())."""
    fields = _fields(flight, "error" if delta.error else delta.finish_reason, now)
    head = {k: fields[k] for k in ("request_id", "internal_id", "status")}
    fields = {**head, "prompt_tokens": delta.prompt_tokens, **fields}   # the line's order as before
    if len(delta.phases) == 3:
        fields.update(zip(("queue_s", "prefill_s", "decode_s"), (round(s, 4) for s in delta.phases)))
    if delta.error:
        fields.update(http_status=delta.status, error=delta.error)
    text = " ".join(f"{k}={v}" for k, v in fields.items() if k not in ("request_id", "error"))
    message = f"request {fields['request_id']} finished: {text}"
    if delta.error:
        message += f": {delta.error}"
    # A failure is a warning: it stays in the log under --disable-log-requests.
    (log.warning if delta.error else log.info)(message, extra={"fields": fields})
