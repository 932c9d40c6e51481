"""The generator process: `python -m stages.generator --address ipc://... [options]`.

Runs the language model with continuous batching. Takes GenerateRequest,
EmbeddingReady and AbortRequest messages at its inbox and streams TokenDelta
messages to each request's reply address. `--mode aggregated` runs the vision
tower here too (no encoders): the baseline EPD is measured against.
SIGTERM or SIGINT stops it.
"""

from __future__ import annotations

import argparse
import logging
import queue
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import zmq

from pipeline import protocol, transport
from pipeline.engine.engine import Engine, EngineConfig
from pipeline.generator.service import GeneratorService
from pipeline.media.registry import create_backend
from pipeline.models.errors import ModelLoadError
from pipeline.models.loader import resolve_device
from pipeline.models.stage_model import add_random_weights_flag, load_stage_model, stage_model_dir
from pipeline.models.vision_flags import add_vision_graph_flags, check_vision_graph_flags, stage_vision_forward
from pipeline.processing.image import ImageDecodeError, ImageProcessorConfig
from pipeline.processing.tokenizer import Tokenizer

log = logging.getLogger("epd.generator")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="stages.generator", description=__doc__.splitlines()[0])
    p.add_argument("--address", required=True, help="inbox address to bind (ipc:// or tcp://)")
    p.add_argument("--instance", default="generator-0")
    p.add_argument("--model", type=Path, help="checkpoint folder (default: the built-in tiny model)")
    add_random_weights_flag(p)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None)
    p.add_argument("--mode", choices=("epd", "aggregated"), default="epd")
    p.add_argument("--encoders", action="append", default=[], help="encoder inbox address; repeatable")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-mib", type=int, default=256)
    p.add_argument("--encoder-cache-tokens", type=int, default=16384)
    p.add_argument("--local-encode-tokens", type=int, default=8192, help="aggregated mode: per step")
    p.add_argument("--embedding-timeout", type=float, default=60.0, help="seconds an image may take")
    p.add_argument("--media-backend", default="auto", help="aggregated mode: image decoder")
    p.add_argument("--decode-matmul", choices=("cublas", "triton"), default=None,
                   help="CUDA: decode steps' projections through cuBLAS or the small-batch Triton matmul "
                        "(default: triton wherever the fused decode kernels run)")
    add_vision_graph_flags(p, "aggregated mode, ")
    p.add_argument("--eager-mixed", action="store_true",
                   help="CUDA: run mixed prefill/decode steps eagerly, not through the fused kernels and "
                        "CUDA graphs (the default wherever decode runs them)")
    args = p.parse_args(argv)
    for name in ("max_num_batched_tokens", "max_num_seqs", "block_size", "kv_cache_mib",
                 "encoder_cache_tokens", "local_encode_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    check_vision_graph_flags(p, args)
    return args


def build_service(args: argparse.Namespace, send) -> GeneratorService:
    device = resolve_device(args.device)
    if device.type == "cuda":
        # Kernels, graphs and Triton launch on the current device's streams:
        # it must be ours, not cuda:0, for a stage placed on another GPU.
        torch.cuda.set_device(device)
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    model_dir = stage_model_dir(args.model, args.random_weights)
    aggregated = args.mode == "aggregated"
    model = load_stage_model(model_dir, args.random_weights, dtype, device,
                             part=None if aggregated else "language")
    config = EngineConfig(args.max_num_batched_tokens, args.max_num_seqs, args.block_size,
                          args.kv_cache_mib << 20, args.encoder_cache_tokens, aggregated,
                          args.local_encode_tokens, fast_mixed=False if args.eager_mixed else None,
                          decode_matmul=args.decode_matmul)
    engine = Engine(model, Tokenizer.from_checkpoint(model_dir), config, device)
    if aggregated:
        engine.runner.vision = stage_vision_forward(model.visual, device, args,
                                                    ImageProcessorConfig.from_checkpoint(model_dir))
    decode = image_decoder(args.media_backend, device, model_dir) if aggregated else None
    return GeneratorService(engine, args.address, device, send, args.encoders, args.embedding_timeout, decode)


def image_decoder(backend: str, device, model_dir: Path):
    """Aggregated mode: media bytes -> [(pixel_values, grid)], ValueError for a bad image."""
    media = create_backend(backend, device)
    image_config = ImageProcessorConfig.from_checkpoint(model_dir)

    def decode(blobs):
        results = media.decode(list(blobs), image_config)
        bad = [str(r) for r in results if isinstance(r, ImageDecodeError)]
        if bad:
            raise ValueError(f"bad image: {bad[0]}")
        return [(r.pixel_values, r.grid) for r in results]

    return decode


def receive(sock: zmq.Socket, inbound: queue.SimpleQueue, stop: threading.Event,
            service: GeneratorService, replies: transport.Outbox) -> None:
    """Receiver thread: frames -> messages for the engine thread, which never
    waits on a socket. Stats requests are answered here, from the engine's
    latest snapshot (with `replies`, this thread's own sockets). Aggregated-
    mode images are decoded on a worker so this thread stays responsive."""
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    with ThreadPoolExecutor(1, "image-decode") as decoder:
        while not stop.is_set():
            if not poller.poll(100):
                continue
            frame = sock.recv(copy=False)
            try:
                message = protocol.decode(frame.buffer)
            except (ValueError, TypeError):
                log.warning("dropped a frame that is not a declared message")
                continue
            if isinstance(message, protocol.StatsRequest):
                replies.try_send(message.reply_to, service.latest_stats)
            elif isinstance(message, protocol.GenerateRequest) and message.media:
                decoder.submit(lambda m=message: inbound.put(service.prepare(m)))
            else:
                inbound.put(message)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = parse_args(sys.argv[1:] if argv is None else argv)
    ctx = zmq.Context()
    outbox = transport.Outbox(ctx)
    try:
        service = build_service(args, outbox.try_send)
    except (ModelLoadError, ValueError, RuntimeError) as exc:
        print(f"stages.generator: error: {exc}", file=sys.stderr)
        return 1
    inbox = transport.make_socket(ctx, zmq.PULL, args.address, bind=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    inbound: queue.SimpleQueue = queue.SimpleQueue()
    replies = transport.Outbox(ctx)
    receiver = threading.Thread(target=receive, args=(inbox, inbound, stop, service, replies), name="receiver",
                                daemon=True)
    receiver.start()
    log.info("generator %s ready on %s (mode %s, device %s)", args.instance, args.address, args.mode,
             service.device)
    try:
        service.run(inbound, stop)
    finally:
        stop.set()
        receiver.join(timeout=2)
        replies.close()
        inbox.close()
        outbox.close()
        ctx.term()
    return 0


if __name__ == "__main__":
    sys.exit(main())
