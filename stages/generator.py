"""The generator process: `python -m stages.generator --address ipc://... [options]`.

Runs the language model with continuous batching. Takes GenerateRequest,
EmbeddingReady and AbortRequest messages at its inbox and streams TokenDelta
messages to each request's reply address. `--mode aggregated` runs the vision
tower here too (no encoders): the baseline EPD is measured against.
`--encode-fallback local` loads the tower in EPD mode too, for the encode
jobs the proxy sends here while no encoder is up. SIGTERM or SIGINT stops it.
"""

from __future__ import annotations

import argparse
import contextlib
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
from pipeline.arena import ring
from pipeline.arg_parser import OneLineParser
from pipeline.cpu_threads import add_cpu_threads_flag, apply_cpu_threads
from pipeline.engine.engine import Engine, EngineConfig
from pipeline.engine.kv_budget import GIB
from pipeline.engine.queue_order import POLICIES
from pipeline.encoder.service import job_video_options
from pipeline.generator.kv_sizing import (
    AUTO, CPU_KV_CACHE_MIB, check_context, kv_cache_bytes, kv_cache_mib_arg, utilization_arg)
from pipeline.generator.internal import AskerRestarted, DecodeSkips, prepare_unless_aborted
from pipeline.generator.local_encode import LocalEncoder, decode_job
from pipeline.generator.media_budget import HeldBytes
from pipeline.generator.service import GeneratorService
from pipeline.incarnations import Incarnations
from pipeline.launcher_watch import LauncherWatch, remove_own_files
from pipeline.logs import add_log_flags, setup_logging
from pipeline.media.registry import create_backend, create_video_backend
from pipeline.media.video_backend import VideoClip
from pipeline.media.video_probe import VideoDecodeError
from pipeline.models.errors import ModelLoadError
from pipeline.models.loader import resolve_device
from pipeline.models.stage_model import add_random_weights_flag, load_stage_model, stage_model_dir
from pipeline.prefill_signal import PrefillSignal
from pipeline.models.vision_flags import add_vision_graph_flags, check_vision_graph_flags, stage_vision_forward
from pipeline.processing.image import ImageDecodeError, ImageProcessorConfig
from pipeline.processing.image_config import add_mm_processor_kwargs_flag
from pipeline.processing.media_prompt import video_tokens_of
from pipeline.processing.processor import video_config_of
from pipeline.processing.tokenizer import Tokenizer
from pipeline.processing.video import VideoOptions
from pipeline.sampling_params import MAX_TOP_LOGPROBS, max_logprobs_of
from pipeline.watchdog import HangWatchdog, add_hang_timeout_flag
from pipeline.models.hub_cache import model_dir_arg

log = logging.getLogger("epd.generator")


def add_fast_path_flags(p: argparse.ArgumentParser) -> None:
    """How the engine's steps run on CUDA: the fused kernels, graphs and decode ahead (each on by default)."""
    p.add_argument("--decode-matmul", choices=("cublas", "triton"), default=None,
                   help="CUDA: decode steps' projections through cuBLAS or the small-batch Triton matmul "
                        "(default: triton wherever the fused decode kernels run)")
    p.add_argument("--no-decode-ahead", action="store_true",
                   help="CUDA: read each decode step's tokens before planning the next, instead of planning "
                        "and launching it while the last one's tokens are read (the default on the fast path)")
    p.add_argument("--no-dependent-launch", action="store_true",
                   help="CUDA: launch the fused kernels plainly, not with programmatic dependent launch "
                        "(the default on GPUs that have it, sm_90 and later)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="CUDA: no CUDA graphs, as vLLM's flag: decode and mixed steps launch their kernels one by "
                        "one (nothing captured at start-up; slower steps); refuses --vision-graphs")
    p.add_argument("--eager-mixed", action="store_true",
                   help="CUDA: run mixed prefill/decode steps eagerly, not through the fused kernels and "
                        "CUDA graphs (the default wherever decode runs them)")


def _add_request_policy_flags(p: argparse.ArgumentParser) -> None:
    """vLLM's flags for how requests are drawn, ordered, cached and answered."""
    p.add_argument("--seed", type=int, metavar="N",
                   help="the random draws of requests without a seed of their own start from N at start-up, as "
                        "vLLM's flag: the same requests in the same order sample the same tokens after a restart")
    p.add_argument("--scheduling-policy", choices=POLICIES, default="fcfs",
                   help="fcfs, or priority: requests by their priority (lower first), then arrival, and the "
                        "least urgent preempted first, as vLLM's flag (default: fcfs)")
    p.add_argument("--max-logprobs", type=int, default=MAX_TOP_LOGPROBS, metavar="N",
                   help="the most top logprobs a request may ask for, per token or prompt token (-1: the whole "
                        f"vocabulary), as vLLM's flag (default: {MAX_TOP_LOGPROBS})")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="keep the KV blocks of computed prompts, by content (tokens and images), for later "
                        "prompts that start the same way, as vLLM's flag (default: on)")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = OneLineParser(prog="stages.generator", description=__doc__.splitlines()[0])
    p.add_argument("--address", required=True, help="inbox address to bind (ipc:// or tcp://)")
    p.add_argument("--instance", default="generator-0")
    p.add_argument("--model", type=model_dir_arg, help="checkpoint folder (default: the built-in tiny model)")
    add_random_weights_flag(p)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None)
    add_cpu_threads_flag(p)
    p.add_argument("--mode", choices=("epd", "aggregated"), default="epd")
    p.add_argument("--encoders", action="append", default=[], help="encoder inbox address; repeatable")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-mib", type=kv_cache_mib_arg, default=AUTO, metavar="MIB|auto",
                   help="KV cache size; auto: from --gpu-memory-utilization on CUDA, "
                        f"{CPU_KV_CACHE_MIB} MiB elsewhere (default: auto)")
    p.add_argument("--gpu-memory-utilization", type=utilization_arg, default=0.9, metavar="F",
                   help="CUDA, --kv-cache-mib auto: the share of the GPU's total memory this process may use "
                        "in all: weights, KV cache, activations, CUDA graphs (default: 0.9)")
    p.add_argument("--max-model-len", type=int, metavar="N",
                   help="prompt plus output tokens a request may have: the KV cache must hold one such request, "
                        "or the generator does not start (default: the checkpoint's context)")
    p.add_argument("--encoder-cache-tokens", type=int, default=16384)
    p.add_argument("--local-encode-tokens", type=int, default=8192,
                   help="aggregated mode, --encode-fallback local: visual tokens encoded here per step")
    p.add_argument("--encode-fallback", choices=("off", "local"), default="off",
                   help="local: load the vision tower in EPD mode too and encode the jobs the proxy sends here "
                        "while no encoder is up (the proxy needs the same flag)")
    p.add_argument("--embedding-timeout", type=float, default=60.0, help="seconds an image may take")
    add_hang_timeout_flag(p, "the engine loop")
    p.add_argument("--media-backend", default="auto", help="aggregated mode, fallback encodes: image decoder")
    add_mm_processor_kwargs_flag(p)
    p.add_argument("--video-backend", default="auto",
                   help="aggregated mode, fallback encodes: video decoder (auto, pyav, dali)")
    p.add_argument("--media-budget-mib", type=int, default=2048,
                   help="aggregated mode: decoded media the generator may hold (requests past it wait as bytes; "
                        "kept out of the KV cache's memory)")
    p.add_argument("--media-decode-workers", type=int, default=4,
                   help="aggregated mode: requests whose media are decoded at once (a clip takes a worker "
                        "hundreds of ms, and one worker made video requests reach the engine one by one)")
    add_vision_graph_flags(p, "aggregated mode and fallback encodes, ")
    p.add_argument("--prefill-pacing-ms", type=float, default=None, metavar="MS",
                   help="hold prefill chunks while decoding requests' mean time between tokens (over the last "
                        "32 steps, the next one counted as long as the last mixed one) would pass MS; requests "
                        "waiting for their first token wait longer instead (default: off)")
    p.add_argument("--prefill-pacing-max-hold-ms", type=float, default=500.0, metavar="MS",
                   help="with --prefill-pacing-ms: the longest prefill is held in a row (default: 500)")
    p.add_argument("--prefill-signal", metavar="PATH",
                   help="set a one-byte file at PATH while a step with prefill tokens runs, for the encoders "
                        "beside this generator on its GPU (their --yield-to-prefill; epd-launch "
                        "--encoder-yield-ms sets both)")
    _add_request_policy_flags(p)
    add_fast_path_flags(p)
    add_log_flags(p)
    args = p.parse_args(argv)
    for name in ("max_num_batched_tokens", "max_num_seqs", "block_size", "max_model_len", "encoder_cache_tokens",
                 "local_encode_tokens", "media_decode_workers", "media_budget_mib"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    check_vision_graph_flags(p, args)
    if args.enforce_eager and args.vision_graphs:
        p.error("--enforce-eager runs no CUDA graphs: drop --vision-graphs")
    if args.prefill_pacing_ms is not None and not args.prefill_pacing_ms > 0:
        p.error("--prefill-pacing-ms must be above 0")
    if not args.prefill_pacing_max_hold_ms >= 0:
        p.error("--prefill-pacing-max-hold-ms must be at least 0")
    if args.mode == "aggregated" and args.encode_fallback != "off":
        p.error("--encode-fallback is for --mode epd (an aggregated generator encodes every image itself)")
    if args.max_logprobs < -1:
        p.error("--max-logprobs must be -1 (the whole vocabulary) or at least 0")
    return args


def build_service(args: argparse.Namespace, send) -> GeneratorService:
    apply_cpu_threads(args.cpu_threads)
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
    # Before the KV cache is sized: its weights are then counted as held.
    tower = fallback_tower(args, model, model_dir, dtype, device) if args.encode_fallback == "local" else None
    kv_bytes, sized_by = kv_cache_bytes(args, model, device)
    check_context(args, model, kv_bytes, sized_by)
    config = EngineConfig(args.max_num_batched_tokens, args.max_num_seqs, args.block_size,
                          kv_bytes, args.encoder_cache_tokens, aggregated,
                          args.local_encode_tokens, fast_mixed=False if args.eager_mixed else None,
                          decode_matmul=args.decode_matmul, decode_ahead=False if args.no_decode_ahead else None,
                          dependent_launch=False if args.no_dependent_launch else None,
                          prefill_pacing_ms=args.prefill_pacing_ms,
                          prefill_pacing_max_hold_ms=args.prefill_pacing_max_hold_ms,
                          cuda_graphs=not args.enforce_eager, prefix_caching=args.enable_prefix_caching,
                          scheduling_policy=args.scheduling_policy,
                          max_logprobs=max_logprobs_of(args.max_logprobs, model.spec.language.vocab_size))
    engine = Engine(model, Tokenizer.from_checkpoint(model_dir), config, device)
    if args.seed is not None:
        torch.manual_seed(args.seed)   # after the weights: a random checkpoint's draws do not shift it
    if args.prefill_signal:
        engine.on_prefill = PrefillSignal(args.prefill_signal, writer=True).set
    blocks = engine.scheduler.config.num_blocks
    log.info("KV cache: %.2f GiB (%d MiB), %d blocks of %d tokens, %d tokens (%s)", kv_bytes / GIB,
             kv_bytes >> 20, blocks, args.block_size, blocks * args.block_size, sized_by)
    images = args.mm_processor_kwargs   # the image settings, as the proxy and the encoders have them
    if aggregated:
        engine.runner.vision = stage_vision_forward(model.visual, device, args,
                                                    ImageProcessorConfig.from_checkpoint(model_dir, images))
    decode, local = None, None
    if aggregated or tower is not None:
        video_config = video_config_of(model_dir, video_tokens_of(engine.model.spec))
        decode_items = media_decoder(args.media_backend, args.video_backend, device, model_dir, video_config, images)
        decode = request_decoder(decode_items) if aggregated else None
    if tower is not None:
        log.info("--encode-fallback local: the vision tower is loaded, for images sent here while no encoder is up")
        forward = stage_vision_forward(tower, device, args, ImageProcessorConfig.from_checkpoint(model_dir, images))
        local = LocalEncoder(forward, job_decoder(decode_items), device, args.local_encode_tokens)
    # Last: nothing after it may fail and leave the rings' shared memory behind.
    rings = {} if aggregated else ring.create_inbound(args.instance, args.encoders)
    return GeneratorService(engine, args.address, device, send, args.encoders, args.embedding_timeout, decode,
                            rings=rings, local=local, watchdog=HangWatchdog(args.hang_timeout))


def fallback_tower(args: argparse.Namespace, model: torch.nn.Module, model_dir: Path, dtype: str,
                   device: torch.device) -> torch.nn.Module:
    """The vision tower for --encode-fallback local: the one a checkpoint
    already loaded beside the language model, else (random weights leave it
    unmade) the one an encoder would make."""
    tower = getattr(model, "visual", None)
    if tower is not None and not any(p.is_meta for p in tower.parameters()):
        return tower
    return load_stage_model(model_dir, args.random_weights, dtype, device, part="visual")


def media_decoder(backend: str, video_backend: str, device, model_dir: Path, video_config,
                  image_overrides: dict[str, int] | None = None):
    """Media decoded here: (kinds, blobs, video options) -> [(pixel_values,
    grid)] per item, ValueError for a bad image or video."""
    media = create_backend(backend, device)
    videos = create_video_backend(video_backend, device) if video_config is not None else None
    image_config = ImageProcessorConfig.from_checkpoint(model_dir, image_overrides)
    # Several workers call these at once (receive); a backend that cannot take that is used by one at a time.
    media_lock = contextlib.nullcontext() if media.thread_safe else threading.Lock()
    video_lock = contextlib.nullcontext() if videos is None or videos.thread_safe else threading.Lock()

    def decode_images(blobs):
        with media_lock:
            results = media.decode(list(blobs), image_config)
        bad = [str(r) for r in results if isinstance(r, ImageDecodeError)]
        if bad:
            raise ValueError(f"bad image: {bad[0]}")
        return [(r.pixel_values, r.grid) for r in results]

    def decode_videos(blobs, options):
        if videos is None:
            raise ValueError("this model takes no video")
        with video_lock:
            results = videos.decode([VideoClip(data, options) for data in blobs], video_config)
        bad = [str(r) for r in results if isinstance(r, VideoDecodeError)]
        if bad:
            raise ValueError(f"bad video: {bad[0]}")
        return [(r.pixel_values, r.plan.grid) for r in results]

    def decode_items(kinds, blobs, options: VideoOptions | None):
        images = iter(decode_images([m for m, k in zip(blobs, kinds) if k == "image"]))
        clips = [m for m, k in zip(blobs, kinds) if k == "video"]
        decoded_clips = iter(decode_videos(clips, options) if clips else ())
        return [next(images) if kind == "image" else next(decoded_clips) for kind in kinds]

    return decode_items


def request_decoder(decode_items):
    """Aggregated mode: a request's media -> [(pixel_values, grid)] per item."""
    def decode(request: protocol.GenerateRequest):
        kinds = request.media_kinds or ("image",) * len(request.media)
        options = None
        if request.video_fps is not None or request.video_frames is not None:
            options = VideoOptions(request.video_fps, request.video_frames)
        return decode_items(kinds, request.media, options)

    return decode


def job_decoder(decode_items):
    """--encode-fallback local: an encode job's media -> (pixel_values, grid)."""
    def decode(job: protocol.EncodeJob):
        if job.modality not in ("image", "video"):
            raise ValueError(f"this generator takes no {job.modality} input")
        return decode_items((job.modality,), (job.media,), job_video_options(job))[0]

    return decode


def receive(sock: zmq.Socket, inbound: queue.SimpleQueue, stop: threading.Event,
            service: GeneratorService, replies: transport.Outbox, decode_workers: int = 1,
            media_budget: int = 2048 << 20) -> None:
    """Receiver thread: frames -> messages for the engine thread, which never
    waits on a socket. Stats requests are answered here, from the engine's
    latest snapshot (with `replies`, this thread's own sockets). Aggregated-
    mode images are decoded on a worker so this thread stays responsive."""
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    # Each stats asker's (a proxy's) incarnation. A new one's first stats request
    # comes before anything else it sends, so what is tracked for its address
    # by then is its predecessor's.
    askers = Incarnations()
    skips, budget = DecodeSkips(), HeldBytes(media_budget)
    watch = LauncherWatch()   # stop once the launcher and every proxy are gone
    with ThreadPoolExecutor(decode_workers, "media-decode") as decoder:
        while not stop.is_set():
            if watch.nobody_left():
                watch.log_stopping("generator")
                stop.set()
                break
            if not poller.poll(100):
                continue
            frame = sock.recv(copy=False)
            try:
                message = protocol.decode(frame.buffer)
            except (ValueError, TypeError):
                log.warning("dropped a frame that is not a declared message")
                continue
            if isinstance(message, protocol.StatsRequest):
                watch.asked()
                replies.try_send(message.reply_to, service.latest_stats)
                if askers.restarted(message.reply_to, message.incarnation):
                    inbound.put(AskerRestarted(message.reply_to))
            elif (isinstance(message, protocol.GenerateRequest) and message.media
                  and service.decode_images is not None):
                skips.add(message.request_id)
                decoder.submit(lambda m=message: inbound.put(
                    prepare_unless_aborted(m, service.decode_images, skips, budget, stop)))
            elif isinstance(message, protocol.EncodeJob) and service.local is not None:
                decoder.submit(lambda m=message: inbound.put(decode_job(m, service.local.decode, budget, stop)))
            else:
                inbound.put(message)
                if isinstance(message, protocol.AbortRequest):
                    skips.abort(message.request_ids)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    setup_logging(args.log_level, args.log_format, args.disable_log_stats, args.disable_log_requests)
    ctx = zmq.Context()
    try:
        # Bound before the model loads: a taken address fails in a second,
        # in one line, with nothing made yet (no rings in /dev/shm).
        inbox = transport.make_socket(ctx, zmq.PULL, args.address, bind=True)
    except (zmq.ZMQError, ValueError) as exc:
        print(f"stages.generator: error: cannot bind {args.address}: {exc}", file=sys.stderr)
        ctx.term()
        return 1
    outbox = transport.Outbox(ctx)
    try:
        service = build_service(args, outbox.try_send)
    except (ModelLoadError, ValueError, RuntimeError) as exc:
        print(f"stages.generator: error: {exc}", file=sys.stderr)
        inbox.close()
        outbox.close()
        ctx.term()
        return 1
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    inbound: queue.SimpleQueue = queue.SimpleQueue()
    replies = transport.Outbox(ctx)
    deaf = threading.Event()

    def receive_or_stop():
        # A generator whose receiver is gone still looks alive but hears
        # nothing: stop it, with a failing exit, so its supervisor restarts it.
        try:
            receive(inbox, inbound, stop, service, replies, args.media_decode_workers, args.media_budget_mib << 20)
        except BaseException:
            log.exception("the receiver thread failed")
        finally:
            if not stop.is_set():
                log.error("the receiver thread ended; stopping this generator")
                deaf.set()
                stop.set()
    receiver = threading.Thread(target=receive_or_stop, name="receiver", daemon=True)
    receiver.start()
    log.info("generator %s ready on %s (mode %s, device %s, %d CPU threads)", args.instance, args.address,
             args.mode, service.device, torch.get_num_threads())
    try:
        service.run(inbound, stop)
    finally:
        stop.set()
        receiver.join(timeout=2)
        replies.close()
        inbox.close()
        remove_own_files(LauncherWatch(), args.address, args.prefill_signal)
        outbox.close()
        ctx.term()
    return 1 if deaf.is_set() else 0


if __name__ == "__main__":
    sys.exit(main())
