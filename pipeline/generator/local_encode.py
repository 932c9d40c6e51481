"""--encode-fallback local: an EPD generator that encodes images itself while
no encoder is up.

The proxy then sends the generator the encode jobs it would send an encoder,
raw media included. A receiver worker decodes a job's media (`decode_job`,
within the media budget), the engine thread runs the vision forward between
steps (`encode_local`), and the embedding enters the engine as an encoder's
would: from there on the request's path is the EPD one. Failures are
answered as an encoder answers them, with EncodeFailed to the job's sender.

The tower is loaded at start-up when the flag is on (its weights, and on a
GPU its forward's activations, are kept out of the KV cache), never on
demand: an outage of the encoders must not be when a generator runs out of
memory.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pipeline import protocol
from pipeline.device_loss import raise_if_lost
from pipeline.generator.intake import take_embedding
from pipeline.generator.media_budget import HeldBytes

log = logging.getLogger("epd.generator")


@dataclass(frozen=True)
class DecodedJob:
    """A fallback encode job whose media a receiver worker decoded (or could not)."""

    job: protocol.EncodeJob
    pixels: torch.Tensor | None = None
    grid: tuple[int, int, int] | None = None
    error: str = ""
    backend_failed: bool = False   # as PreparedRequest's (internal.py)


@dataclass(frozen=True)
class LocalResult:
    job: protocol.EncodeJob
    embedding: torch.Tensor | None = None
    error: str = ""
    retryable: bool = False


def decode_job(job: protocol.EncodeJob, decode: Callable, budget: HeldBytes,
               stop: threading.Event) -> DecodedJob:
    """A receiver worker's part: `decode(job)` -> (pixels, grid), ValueError
    for bad media; handed on once the media budget has room for the pixels."""
    try:
        pixels, grid = decode(job)
    except ValueError as exc:
        return DecodedJob(job, error=str(exc))
    except Exception as exc:   # a backend failure: on a worker, it would be lost with its job
        log.exception("decoding the media of job %s failed", job.job_id)
        return DecodedJob(job, error=f"media decoding failed: {exc}", backend_failed=True)
    if not budget.hold([pixels], stop):
        return DecodedJob(job, error="the generator is stopping")
    return DecodedJob(job, pixels, tuple(grid))


class LocalEncoder:
    """The decoded jobs waiting for the vision forward, and the forward.

    `forward(pixels, grids)` is the tower's (one embedding per item);
    `decode(job)` is run by the receiver's workers, never here."""

    def __init__(self, forward: Callable, decode: Callable, device: torch.device, max_tokens: int) -> None:
        self.forward = forward
        self.decode = decode
        self.device = device
        self.max_tokens = max_tokens   # visual tokens per forward (at least one item)
        self.queue: deque[DecodedJob] = deque()

    def encode_some(self, gone: Callable[[str], bool]) -> list[LocalResult]:
        """The next batch's results; jobs whose request is `gone` are dropped unencoded."""
        batch, tokens, results = [], 0, []
        while self.queue and (not batch or tokens + self.queue[0].job.expected_tokens <= self.max_tokens):
            item = self.queue.popleft()
            if gone(item.job.request_id):
                continue
            if item.error:
                results.append(LocalResult(item.job, error=item.error))   # bad media: no retry helps
                continue
            batch.append(item)
            tokens += item.job.expected_tokens
        return results + (self._forward(batch) if batch else [])

    def _forward(self, batch: list[DecodedJob]) -> list[LocalResult]:
        try:
            pixels = torch.cat([item.pixels.to(self.device, non_blocking=True) for item in batch])
            with torch.inference_mode():
                outputs = self.forward(pixels, [item.grid for item in batch])
        except Exception as exc:   # a failed forward fails its jobs, not the generator, unless its GPU is gone
            log.exception("local vision forward of %d item(s) failed", len(batch))
            raise_if_lost(self.device, exc)
            return [LocalResult(item.job, error=f"generator error while encoding: {exc}", retryable=True)
                    for item in batch]
        results = []
        for item, embedding in zip(batch, outputs):
            expected = item.job.expected_tokens
            if embedding.shape[0] != expected:
                results.append(LocalResult(item.job, error=f"the image has {embedding.shape[0]} visual tokens but "
                                                           f"its prompt reserved {expected}"))
            else:
                results.append(LocalResult(item.job, embedding))
        return results


# The steps below take the GeneratorService (not imported: it imports this).

def encode_local(service) -> None:
    """Engine thread, once a turn: encode what is decoded, hand the
    embeddings to the engine, answer failures to the jobs' senders."""
    if service.local is None or not service.local.queue:
        return
    for result in service.local.encode_some(service.requests.gone):
        job = result.job
        if result.embedding is None:
            service.send(job.reply_to, protocol.EncodeFailed(job.job_id, job.request_id, job.content_hash,
                                                             result.error, result.retryable, service.address))
            continue
        service.counters["fallback_encodes"] += 1
        take_embedding(service, job.request_id, job.content_hash, result.embedding)


def refuse_job(service, job: protocol.EncodeJob) -> None:
    """An encode job for a generator without a tower: the proxy asks for
    the fallback that this generator was not started with."""
    log.warning("encode job %s refused: this generator was not started with --encode-fallback local", job.job_id)
    service.send(job.reply_to, protocol.EncodeFailed(
        job.job_id, job.request_id, job.content_hash,
        "its generator encodes no images (start generators with --encode-fallback local too)", True,
        service.address))
