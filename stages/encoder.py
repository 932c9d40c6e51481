"""The encoder process: `python -m stages.encoder --address ipc://... [options]`.

Binds an inbox, takes encode jobs from any proxy, and hands embeddings to the
generators named in the jobs through its arena. It announces itself (arena,
widths, model id) to every address given with --announce-to, and to anyone
who sends Hello. SIGTERM or SIGINT stops it cleanly: shared memory is removed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import zmq
import zmq.asyncio

from pipeline import protocol, transport
from pipeline.arena.store import ArenaStore
from pipeline.arg_parser import OneLineParser
from pipeline.cpu_threads import add_cpu_threads_flag, apply_cpu_threads
from pipeline.encoder.service import EncoderService, EncoderSettings
from pipeline.launcher_watch import LauncherWatch, remove_own_files, until_nobody_left
from pipeline.logs import add_log_flags, setup_logging
from pipeline.media.registry import create_backend, create_video_backend
from pipeline.models.errors import ModelLoadError
from pipeline.models.loader import load_config, resolve_device
from pipeline.models.stage_model import add_random_weights_flag, load_stage_model, stage_model_dir
from pipeline.models.vision_flags import add_vision_graph_flags, check_vision_graph_flags, stage_vision_forward
from pipeline.processing.image import ImageProcessorConfig
from pipeline.processing.image_config import add_mm_processor_kwargs_flag
from pipeline.processing.media_prompt import video_tokens_of
from pipeline.processing.processor import video_config_of
from pipeline.prefill_signal import PrefillHold, PrefillSignal
from pipeline.watchdog import HangWatchdog, add_hang_timeout_flag
from pipeline.models.hub_cache import model_dir_arg

log = logging.getLogger("epd.encoder")


# The arena holds every embedding until evicted: on a GPU 4 GiB keeps ~1,900
# images of 640x640 for a 3B-class model (2.2 MB each) for dedup hits, a
# few percent of an 80-141 GB device; on the CPU it is shared memory, where
# 256 MiB is plenty for tests and a laptop.
CUDA_ARENA_MIB = 4096
CPU_ARENA_MIB = 256


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = OneLineParser(prog="stages.encoder", description=__doc__.splitlines()[0])
    p.add_argument("--address", required=True, help="inbox address to bind (ipc:// or tcp://)")
    p.add_argument("--instance", default="encoder-0", help="stable name of this stage (shm cleanup, ids)")
    p.add_argument("--model", type=model_dir_arg, help="checkpoint folder (default: the built-in tiny model)")
    add_random_weights_flag(p)
    p.add_argument("--model-id", help="name used to salt content hashes (default: the folder name)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="default: bfloat16 on CUDA, float32 on CPU")
    add_cpu_threads_flag(p)
    p.add_argument("--media-backend", default="auto", help="image decoder: auto, pillow, dali or nvjpeg")
    add_mm_processor_kwargs_flag(p)
    p.add_argument("--video-backend", default="auto",
                   help="video decoder: auto (DALI's NVDEC on CUDA, else PyAV), pyav or dali")
    p.add_argument("--arena-mib", type=int, default=None,
                   help=f"embedding arena size (default: {CUDA_ARENA_MIB} on CUDA, {CPU_ARENA_MIB} elsewhere)")
    p.add_argument("--block-kib", type=int, default=64, help="arena block size")
    p.add_argument("--max-batch-tokens", type=int, default=16384, help="visual tokens per forward")
    add_vision_graph_flags(p)
    p.add_argument("--yield-to-prefill", action="append", default=[], metavar="PATH",
                   help="a generator's --prefill-signal file: run one image a forward, each held while a "
                        "generator beside this encoder runs a prefill step; repeatable")
    p.add_argument("--yield-max-ms", type=float, default=30.0, metavar="MS",
                   help="with --yield-to-prefill: the longest one forward is held (default: 30)")
    p.add_argument("--lease-timeout", type=float, default=30.0, help="seconds without heartbeat")
    add_hang_timeout_flag(p, "a vision forward, or the event loop,")
    p.add_argument("--decode-threads", type=int, default=4)
    p.add_argument("--announce-to", action="append", default=[], help="inbox to announce to; repeatable")
    add_log_flags(p)
    args = p.parse_args(argv)
    for name in ("arena_mib", "block_kib", "max_batch_tokens", "decode_threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    check_vision_graph_flags(p, args)
    if not args.yield_max_ms > 0:
        p.error(f"--yield-max-ms must be > 0 (got {args.yield_max_ms:g})")
    return args


async def serve(args: argparse.Namespace) -> None:
    ctx = zmq.asyncio.Context()
    try:
        # Bound before the model loads: a taken address fails in a second,
        # in one line, with nothing made yet.
        inbox = transport.Inbox(ctx, args.address)
    except zmq.ZMQError as exc:
        ctx.term()
        raise ValueError(f"cannot bind {args.address}: {exc}") from None
    outbox = transport.Outbox(ctx)
    try:
        with contextlib.ExitStack() as cleanup:
            await _serve(args, inbox, outbox, cleanup)
    finally:
        inbox.close()
        outbox.close()
        ctx.term()
        remove_own_files(LauncherWatch(), args.address)


async def _serve(args: argparse.Namespace, inbox: transport.Inbox, outbox: transport.Outbox,
                 cleanup: contextlib.ExitStack) -> None:
    """Everything made here is undone by `cleanup`, whatever fails: the
    arena's shared memory above all."""
    apply_cpu_threads(args.cpu_threads)
    device = resolve_device(args.device)
    if device.type == "cuda":
        # Kernels, graphs and Triton launch on the current device's streams:
        # it must be ours, not cuda:0, for a stage placed on another GPU.
        torch.cuda.set_device(device)
    dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    model_dir = stage_model_dir(args.model, args.random_weights)
    tower = load_stage_model(model_dir, args.random_weights, dtype, device, part="visual")
    image_config = ImageProcessorConfig.from_checkpoint(model_dir, args.mm_processor_kwargs)
    family, config = load_config(model_dir)
    video_config = video_config_of(model_dir, video_tokens_of(family.spec(config)))
    media = create_backend(args.media_backend, device)
    video_media = create_video_backend(args.video_backend, device)
    cleanup.callback(video_media.close)
    arena_mib = args.arena_mib or (CUDA_ARENA_MIB if device.type == "cuda" else CPU_ARENA_MIB)
    store = ArenaStore(arena_mib << 20, args.block_kib << 10, device, args.instance, args.lease_timeout)
    cleanup.callback(store.close)
    settings = EncoderSettings(args.instance, args.address, args.model_id or Path(model_dir).name,
                               args.max_batch_tokens)
    decode_pool = cleanup.enter_context(ThreadPoolExecutor(args.decode_threads, "decode"))
    compute_pool = cleanup.enter_context(ThreadPoolExecutor(1, "compute"))
    service = EncoderService(settings, store, tower, media, image_config, outbox.try_send,
                             decode_pool, compute_pool,
                             stage_vision_forward(tower, device, args, image_config), video_config,
                             video_media, HangWatchdog(args.hang_timeout), prefill_hold(args, cleanup))
    cleanup.callback(service.lanes.close)
    for address in args.announce_to:
        service.handle_hello(address)
    log.info("encoder %s ready on %s (device %s, media %s, video %s, arena %d MiB, %d CPU threads)",
             args.instance, args.address, device, media.name, video_media.name, arena_mib, torch.get_num_threads())
    watch = LauncherWatch()   # stop once the launcher and every proxy are gone
    await _until_stopped(service.run(), _receive(inbox, service, watch), until_nobody_left(watch, "encoder"))


def prefill_hold(args: argparse.Namespace, cleanup: contextlib.ExitStack) -> PrefillHold | None:
    if not args.yield_to_prefill:
        return None
    hold = PrefillHold([PrefillSignal(path) for path in args.yield_to_prefill], args.yield_max_ms / 1e3)
    cleanup.callback(hold.close)
    log.info("forwards of one image, each held up to %g ms while a generator beside this encoder prefills",
             args.yield_max_ms)
    return hold


async def _receive(inbox: transport.Inbox, service: EncoderService, watch: LauncherWatch) -> None:
    while True:
        message = await inbox.recv()
        if isinstance(message, protocol.StatsRequest):
            watch.asked()
        try:
            service.handle(message)
        except Exception:   # one peer's odd message must not stop the encoder for every other
            log.exception("handling a %s failed", type(message).__name__)


async def _until_stopped(*work) -> None:
    """Run until SIGTERM/SIGINT, until any task fails, or until one (the launcher watch) returns."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    tasks = [asyncio.ensure_future(w) for w in work] + [asyncio.ensure_future(stop.wait())]
    done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)
    for task in done:
        task.result()  # re-raise a failure


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    setup_logging(args.log_level, args.log_format, args.disable_log_stats, args.disable_log_requests)
    transport.install_event_loop()
    try:
        asyncio.run(serve(args))
    except (ModelLoadError, ValueError, RuntimeError) as exc:
        print(f"stages.encoder: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
