"""The generator's message table: which handler takes each kind of message
the engine thread is handed (protocol messages, and the receiver's own in
internal.py and local_encode.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable

from pipeline import protocol
from pipeline.device_loss import raise_if_lost
from pipeline.generator.announcements import on_announce
from pipeline.generator.intake import on_embedding
from pipeline.generator.internal import AskerRestarted, PreparedRequest
from pipeline.generator.local_encode import DecodedJob, refuse_job
from pipeline.generator.refetch import want_again

log = logging.getLogger("epd.generator")

Handler = Callable[[object], None]


def handler_table(service) -> dict[type, Handler]:
    """`service` is the GeneratorService (not imported: it imports this).
    Looked up by exact type: every kind handed to the engine thread is listed."""
    return {
        protocol.GenerateRequest: service.on_generate,
        PreparedRequest: lambda m: prepared_request(service, m),
        protocol.EmbeddingReady: lambda m: on_embedding(service, m),
        protocol.EncodeFailed: lambda m: on_encode_failed(service, m),
        DecodedJob: lambda m: local_job(service, m),
        protocol.EncodeJob: lambda m: refuse_job(service, m),   # a receiver without a tower passes them on
        protocol.AbortRequest: lambda m: on_abort(service, m),
        protocol.EncoderAnnounce: lambda m: on_announce(service, m),
        protocol.Wake: lambda m: None,    # it woke the loop, which reads the rings next
        AskerRestarted: lambda m: on_asker_restarted(service, m),
    }


def dispatch(table: dict[type, Handler], message) -> None:
    handler = table.get(type(message))
    if handler is None:
        log.warning("ignoring unexpected %s", type(message).__name__)
        return
    handler(message)


def on_encode_failed(service, message: protocol.EncodeFailed) -> None:
    """The answer to a FetchEmbedding (proxies get their own jobs' failures)."""
    if message.retryable:
        want_again(service, message.content_hash, message.reason)
    else:
        service.fail_key(message.content_hash, f"image encoding failed: {message.reason}", 400)


def prepared_request(service, prepared: PreparedRequest) -> None:
    if prepared.backend_failed:   # a decoder that failed on a lost GPU fails every request after it
        raise_if_lost(service.device, RuntimeError(prepared.error))
    service.on_generate(prepared.request, prepared.inputs, prepared.error, 500 if prepared.backend_failed else 400)


def local_job(service, job: DecodedJob) -> None:
    if job.backend_failed:
        raise_if_lost(service.device, RuntimeError(job.error))
    service.local.queue.append(job)


def on_abort(service, message: protocol.AbortRequest) -> None:
    for request_id in message.request_ids:
        service.requests.abort(request_id)
        service.engine.abort(request_id)


def on_asker_restarted(service, message: AskerRestarted) -> None:
    orphans = service.requests.sent_by(message.address)
    for request_id in orphans:
        service.requests.end(request_id)
        service.engine.abort(request_id)
    log.warning("%s restarted: dropped the %d request(s) its predecessor sent", message.address, len(orphans))
