"""Start a whole EPD box: encoders, generators and the OpenAI proxy, one process each.

Prints `EPD ready: http://HOST:PORT/v1` once the proxy's /health answers 200,
restarts a stage that dies, and on SIGINT/SIGTERM stops every stage and exits
0. Bad options exit 2 with one line on stderr; a stage that cannot start, or
keeps dying, exits 1. Without --model it serves the built-in tiny model on
the CPU.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from pathlib import Path

from pipeline import transport
from pipeline.arg_parser import OneLineParser, human_readable_int, image_size
from pipeline.launch.auto_placement import PlanWorkload, choose_placement
from pipeline.launch.config import ENCODE_FALLBACKS, ConfigError, dump_config, expand_config, settings_of
from pipeline.launch.placement import PLACEMENTS, describe
from pipeline.launch.plan import (
    DEVICES, DTYPES, ENCODER_PRIORITIES, MODES, MPS_MODES, ROLES, LaunchError, LaunchOptions, host_facts, http_url,
    mps_config, plan_gpus, plan_stages, uses_cuda)
from pipeline.launch.supervisor import SupervisorConfig, run_supervisor
from pipeline.launch.systemd_units import write_units
from pipeline.logs import FORMATS, LEVELS
from pipeline.processing.chat_template import is_template_text
from pipeline.processing.image_config import mm_processor_kwargs_arg
from pipeline.models.shape_configs import SHAPES  # torch-free
from pipeline.models.hub_cache import resolve_model
from pipeline.launch.vllm_flags import add_vllm_flags, check_vllm_flags, optimization_level, vllm_stage_flags

# vllm serve's --block-size choices (the generators take any size; scripts/gpu_block_size_check.py
# checks the GPU kernels at each of these).
BLOCK_SIZES = (1, 8, 16, 32, 64, 128)


def _add_mps_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mps", choices=MPS_MODES, default="auto",
                   help="a private NVIDIA MPS daemon for the GPU stages: auto (where stages share a GPU), "
                   "on (always; fail if it cannot start), off; an operator's daemon is used when "
                   "CUDA_MPS_PIPE_DIRECTORY is set")
    p.add_argument("--encoder-sm-percent", type=int, metavar="N",
                   help="MPS: cap each encoder at N%% of its GPU's SMs (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE; "
                   "default: no cap)")
    p.add_argument("--encoder-yield-ms", type=float, metavar="MS",
                   help="encoders beside a generator on its GPU run one image a forward, each held up to MS "
                   "while that generator runs a prefill step (default: off)")
    p.add_argument("--encoder-priority", choices=ENCODER_PRIORITIES, default="normal",
                   help="MPS: the encoders' client priority (CUDA_MPS_CLIENT_PRIORITY); below-normal: where "
                   "both are ready, the generators' kernels are scheduled first (default: normal)")


def build_parser() -> OneLineParser:
    p = OneLineParser(prog="epd-launch", description=__doc__.splitlines()[0])
    p.add_argument("--encoders", type=int, metavar="N",
                   help="encoder processes (default: 1; 0 with --mode aggregated)")
    p.add_argument("--generators", type=int, default=1, metavar="M", help="generator processes")
    p.add_argument("model_tag", nargs="?", metavar="MODEL",
                   help="as in `vllm serve MODEL`: the same as --model")
    p.add_argument("--model", metavar="DIR|ID",
                   help="checkpoint folder, or a Hugging Face repo id already in the local cache "
                   "(default: the built-in tiny model; a repo id is resolved with --revision and --download-dir)")
    p.add_argument("--random-weights", metavar="SHAPE",
                   help=f"serve random weights of a named model shape ({', '.join(SHAPES)}), made on each "
                   "stage's device, with a synthetic tokenizer; instead of --model")
    p.add_argument("--model-id", metavar="ID",
                   help="name salting content hashes, the same for every stage (default: the folder name)")
    p.add_argument("--host", default="127.0.0.1", help="address the proxy listens on")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--mode", choices=MODES, default="epd",
                   help="aggregated: no encoders, generators run the vision tower themselves")
    p.add_argument("--encode-fallback", choices=ENCODE_FALLBACKS, default="off",
                   help="local: while no encoder is up, generators encode the images themselves (each loads the "
                   "vision tower at start); off (default): image requests wait for an encoder")
    p.add_argument("--config", metavar="FILE", help="a YAML file of these flags (keys without the dashes; the "
                   "command line overrides it): see docs/operations.md")
    p.add_argument("--dtype", choices=("auto", *DTYPES), help="auto (default): bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="auto: the GPUs for --model, the CPU for the built-in tiny model")
    p.add_argument("--gpus", type=_gpu_list, metavar="LIST",
                   help="comma-separated GPU numbers as nvidia-smi shows them (default: every visible GPU)")
    p.add_argument("--placement", choices=PLACEMENTS, default="auto",
                   help="colocated: a generator on every GPU, encoders beside them (free GPUs first); "
                   "dedicated: one stage per GPU, encoders first, round-robin past the GPU count; "
                   "auto (default): the planner's pick from a profile (--profile), else colocated")
    _add_mps_flags(p)
    auto = p.add_argument_group("--placement auto: the profile and the workload to plan for")
    auto.add_argument("--profile", type=Path, metavar="FILE",
                      help="bin/epd-plan's profile (default: the one it cached for this model and GPU)")
    auto.add_argument("--images", type=int, default=1, help="images per request (default 1)")
    auto.add_argument("--image-size", type=image_size, default=(640, 640), metavar="WxH")
    auto.add_argument("--input-len", type=int, default=400, help="text tokens per request (default 400)")
    auto.add_argument("--output-len", type=int, default=150, help="output tokens per request (default 150)")
    auto.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    auto.add_argument("--slo-tpot-ms", type=float, default=50.0)
    _add_engine_and_api_flags(p)
    add_vllm_flags(p)
    p.add_argument("--log-level", choices=LEVELS, help="every stage's (default: info)")
    p.add_argument("--log-format", choices=FORMATS, help="every stage's: text (default) or json lines")
    p.add_argument("--disable-log-stats", action="store_true",
                   help="as vllm serve: no periodic profile lines from the encoders and generators")
    p.add_argument("--disable-log-requests", action="store_true",
                   help="as vllm serve: no line per finished request (failures are still logged)")
    p.add_argument("--enable-log-requests", action="store_true",
                   help="as vllm serve: accepted; the line per finished request is on by default here")
    p.add_argument("--write-systemd", type=Path, metavar="DIR",
                   help="write the box's systemd units and config file (these flags) into DIR, then exit")
    p.add_argument("--log-dir", type=Path, metavar="DIR",
                   help="write <instance>.log files here instead of prefixed lines on stdout")
    p.add_argument("--stage-arg", action="append", type=_stage_arg, default=[], metavar="ROLE=ARG",
                   help=f"extra flag for every stage of ROLE ({', '.join(ROLES)}), e.g. "
                   "generator=--max-num-seqs=32; repeatable")
    p.add_argument("--ready-timeout", type=float, default=180.0, metavar="S",
                   help="seconds to wait for the proxy's /health")
    p.add_argument("--drain-timeout", type=float, default=30.0, metavar="S",
                   help="on stop, seconds the requests in flight get to finish (the proxy refuses new "
                   "connections meanwhile; the other stages stop after it)")
    p.add_argument("--stop-timeout", type=float, default=15.0, metavar="S",
                   help="seconds between SIGTERM and SIGKILL (the proxy's: after --drain-timeout)")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = build_parser()
    model_flag = any(arg == "--model" or arg.startswith("--model=") for arg in argv)   # before the file's
    try:
        argv = expand_config(argv)
    except ConfigError as exc:
        p.error(str(exc))
    args = p.parse_args(argv)
    if args.model_tag is not None:
        # The command line overrides a config file's model; on the command line, once.
        if model_flag and args.model != args.model_tag:
            p.error(f"the model is given twice, as {args.model_tag} and as --model {args.model}")
        args.model = args.model_tag
    del args.model_tag
    if args.model is not None:   # after parsing: --revision and --download-dir say which snapshot, and where
        try:
            args.model = resolve_model(args.model, args.revision, args.download_dir)
        except argparse.ArgumentTypeError as exc:
            p.error(f"argument --model: {exc}")
    if args.dtype == "auto":
        args.dtype = None
    if args.encoders is None:
        args.encoders = 0 if args.mode == "aggregated" else 1
    for name in ("ready_timeout", "stop_timeout", "slo_ttft_ms", "slo_tpot_ms"):
        if not getattr(args, name) > 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    for name in ("images", "input_len"):
        if getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0")
    if args.output_len < 1:
        p.error("--output-len must be at least 1")
    if args.prefill_pacing_ms is not None and not args.prefill_pacing_ms > 0:
        p.error("--prefill-pacing-ms must be > 0")
    if args.prefill_pacing_max_hold_ms is not None and not args.prefill_pacing_max_hold_ms >= 0:
        p.error("--prefill-pacing-max-hold-ms must be >= 0")
    if args.mode == "aggregated" and args.encode_fallback != "off":
        p.error("--encode-fallback is for --mode epd (aggregated generators encode every image themselves)")
    if args.max_logprobs is not None and args.max_logprobs < -1:
        p.error("--max-logprobs must be -1 (the whole vocabulary) or at least 0")
    check_vllm_flags(p, args)
    return args


def _add_engine_and_api_flags(p: argparse.ArgumentParser) -> None:
    """The flags vllm serve names the same, for the generators and the proxy."""
    engine = p.add_argument_group("the engine, named as vllm serve names them (passed to every generator)")
    engine.add_argument("--gpu-memory-utilization", type=float, metavar="F",
                        help="share of each GPU a generator may use (default 0.9 alone, split where stages share)")
    engine.add_argument("--max-num-seqs", type=int, metavar="N", help="requests a generator runs at once")
    engine.add_argument("--max-num-batched-tokens", type=human_readable_int, metavar="N",
                        help="tokens a step may compute (4096, 8k, ...)")
    engine.add_argument("--block-size", type=int, choices=BLOCK_SIZES, metavar="N",
                        help=f"tokens per KV cache block, one of {', '.join(map(str, BLOCK_SIZES))} (default: 16)")
    engine.add_argument("--enforce-eager", action="store_true",
                        help="no CUDA graphs in the generators: nothing captured at start-up, slower steps "
                        "(encoders replay vision graphs only when given --vision-graphs)")
    engine.add_argument("-O", "--optimization-level", type=optimization_level, metavar="0-3",
                        help="vLLM's levels: 0 captures no CUDA graphs (as --enforce-eager); 1, 2 and 3 (the "
                        "default is 2) all mean the generators' captured steps, the only compiled form here")
    engine.add_argument("--seed", type=int, metavar="N",
                        help="the generators' random draws for requests without a seed start from N (default: none)")
    engine.add_argument("--scheduling-policy", choices=("fcfs", "priority"),
                        help="fcfs, or priority: requests by their priority field, lower first (default: fcfs)")
    engine.add_argument("--max-logprobs", type=int, metavar="N",
                        help="the most top logprobs a request may ask for (-1: the whole vocabulary; passed to the "
                        "generators and the proxy; default: 20)")
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        help="reuse the KV of prompts' common starts, images included (default: on)")
    engine.add_argument("--max-model-len", type=human_readable_int, metavar="N",
                        help="prompt plus output tokens a request may have, e.g. 32k (the proxy refuses more, and a "
                        "generator whose KV cache cannot hold one such request does not start; default: the "
                        "checkpoint's)")
    engine.add_argument("--limit-mm-per-prompt", type=_mm_limits, metavar="JSON",
                        help='e.g. \'{"image": 4, "video": 1}\': the proxy refuses a request with more media; '
                        "our limit is one count over images and videos together (their sum)")
    engine.add_argument("--mm-processor-kwargs", type=mm_processor_kwargs_arg, metavar="JSON",
                        help="the image processor's bounds for every request, e.g. '{\"max_pixels\": 1003520}' "
                        "(passed to the proxy, the encoders and the generators alike)")
    engine.add_argument("--prefill-pacing-ms", type=float, metavar="MS",
                        help="ours (vllm serve has none): hold prefill while decoding requests' mean time between "
                        "tokens would pass MS, trading time to first token for steadier decode (default: off)")
    engine.add_argument("--prefill-pacing-max-hold-ms", type=float, metavar="MS",
                        help="with --prefill-pacing-ms: the longest prefill is held in a row (default: 500)")
    api = p.add_argument_group("the OpenAI API (passed to the proxy; see python3 -m stages.proxy --help)")
    api.add_argument("--served-model-name", nargs="+", metavar="NAME", help="names clients may ask for")
    api.add_argument("--chat-template", metavar="FILE|TEMPLATE",
                     help="a Jinja chat template instead of the checkpoint's (a file is passed as its path)")
    api.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (default: $EPD_API_KEY; none)")
    api.add_argument("--allowed-origins", metavar="JSON", help='CORS origins, a JSON list (default: ["*"])')
    api.add_argument("--responses-store-mb", type=float, metavar="MB",
                     help="memory for the Responses API's stored answers; 0 stores none (default: 64)")


def _gpu_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GPU numbers like 0,1,3 (got {text!r})") from None


def _mm_limits(text: str) -> dict[str, int]:
    try:
        limits = json.loads(text)
    except ValueError:
        limits = None
    if (not isinstance(limits, dict) or set(limits) - {"image", "video"}
            or not all(isinstance(v, int) and v >= 0 for v in limits.values())):
        raise argparse.ArgumentTypeError(f'expected JSON like {{"image": 4, "video": 1}} (got {text!r})')
    return limits


def _stage_arg(text: str) -> tuple[str, str]:
    role, sep, arg = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected ROLE=ARG like generator=--max-num-seqs=32 (got {text!r})")
    return role, arg


def build_options(args: argparse.Namespace) -> LaunchOptions:
    model = None
    if args.model is not None:
        model = args.model.resolve()
        if not model.is_dir():
            raise LaunchError(f"--model {args.model}: no such folder")
    # One socket folder per port: two launchers on one host (different ports)
    # never bind each other's ipc:// paths.
    run_dir = transport.private_run_dir() / f"port-{args.port}"
    options = LaunchOptions(args.encoders, args.generators, run_dir, model, args.model_id, args.host,
                            args.port, args.mode, args.dtype, args.device, args.gpus,
                            tuple(args.stage_arg) + forwarded_stage_args(args),
                            random_weights=args.random_weights, drain_timeout=args.drain_timeout,
                            placement=args.placement, mps=args.mps, encoder_sm_percent=args.encoder_sm_percent,
                            encoder_priority=args.encoder_priority, encoder_yield_ms=args.encoder_yield_ms,
                            profile=args.profile)
    run_dir.mkdir(mode=0o700, exist_ok=True)
    return options


def forwarded_stage_args(args: argparse.Namespace) -> tuple[tuple[str, str], ...]:
    """The engine and API flags as the generators' and the proxy's own."""
    out = []
    for name in ("gpu_memory_utilization", "max_num_seqs", "max_num_batched_tokens", "block_size", "prefill_pacing_ms",
                 "prefill_pacing_max_hold_ms", "seed"):
        if getattr(args, name) is not None:
            out.append(("generator", f"--{name.replace('_', '-')}={getattr(args, name)}"))
    if args.enforce_eager or args.optimization_level == 0:
        out.append(("generator", "--enforce-eager"))
    if args.enable_prefix_caching is not None:
        out.append(("generator", f"--{'' if args.enable_prefix_caching else 'no-'}enable-prefix-caching"))
    if args.scheduling_policy is not None:   # the proxy refuses priorities unless the generators take them
        out += [(role, f"--scheduling-policy={args.scheduling_policy}") for role in ("generator", "proxy")]
    for name in ("log_level", "log_format"):
        if getattr(args, name) is not None:
            out += [(role, f"--{name.replace('_', '-')}={getattr(args, name)}") for role in ROLES]
    for name in ("disable_log_stats", "disable_log_requests"):
        if getattr(args, name):
            out += [(role, f"--{name.replace('_', '-')}") for role in ROLES]
    if args.encode_fallback != "off":
        out += [(role, f"--encode-fallback={args.encode_fallback}") for role in ("generator", "proxy")]
    if args.max_model_len is not None:   # the proxy refuses longer requests; a generator checks its KV cache
        out += [(role, f"--max-model-len={args.max_model_len}") for role in ("generator", "proxy")]
    if args.max_logprobs is not None:   # the proxy refuses more at once; a generator checks again
        out += [(role, f"--max-logprobs={args.max_logprobs}") for role in ("generator", "proxy")]
    if args.limit_mm_per_prompt is not None:
        out.append(("proxy", f"--max-images={sum(args.limit_mm_per_prompt.values())}"))
    if args.mm_processor_kwargs is not None:   # the same everywhere, or a prompt's image tokens disagree
        value = json.dumps(args.mm_processor_kwargs)
        out += [(role, f"--mm-processor-kwargs={value}") for role in ("proxy", "encoder", "generator")]
    out += vllm_stage_flags(args)
    if args.served_model_name:   # nargs="+" on the proxy: one flag, then every name
        out += [("proxy", "--served-model-name"), *(("proxy", name) for name in args.served_model_name)]
    if args.api_key:
        out.append(("proxy", f"--api-key={args.api_key}"))
    if args.chat_template:
        value = args.chat_template
        if not is_template_text(value):
            value = str(Path(value).resolve())   # a file: the proxy's working folder may differ
        out.append(("proxy", f"--chat-template={value}"))
    if args.allowed_origins:
        out.append(("proxy", f"--allowed-origins={args.allowed_origins}"))
    if args.responses_store_mb is not None:
        out.append(("proxy", f"--responses-store-mb={args.responses_store_mb}"))
    return tuple(out)


def check_port_free(host: str, port: int) -> None:
    """Another server on the port could answer /health for us; refuse early."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise LaunchError(f"--host {host}: {exc.strerror}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError as exc:
            raise LaunchError(f"--port {port}: cannot listen on {host}: {exc.strerror}") from None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.write_systemd is not None:
        return write_systemd(args)
    try:
        options = build_options(args)
        check_port_free(options.host, options.port)
        facts = host_facts(options)
        specs, line = plan_box(options, facts, args)
        mps = mps_config(options, specs, options.run_dir)
        log_dir = None
        if args.log_dir is not None:
            log_dir = args.log_dir.resolve()
            log_dir.mkdir(parents=True, exist_ok=True)
    except LaunchError as exc:
        print(f"epd-launch: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the run or log folder
        print(f"epd-launch: error: {exc.filename}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    if uses_cuda(options, facts):
        line += ("; MPS: a daemon for every GPU stage" if mps else "; MPS off" if options.mps == "off" else
                 "; MPS not needed: no GPU is shared")
    print(line, flush=True)
    tls = bool(args.ssl_certfile)
    health = http_url(options.host, options.port, "/health", for_client=True, tls=tls)
    config = SupervisorConfig(tuple(specs), health, http_url(options.host, options.port, "/v1", tls=tls),
                              ready_timeout=args.ready_timeout, stop_timeout=args.stop_timeout, log_dir=log_dir,
                              drain_timeout=options.drain_timeout, mps=mps)
    return run_supervisor(config)


def write_systemd(args: argparse.Namespace) -> int:
    """The units for this topology: the MPS daemon's too where stages share a GPU (as planned on this host)."""
    try:
        options = build_options(args)
        facts = host_facts(options)
        specs, _ = plan_box(options, facts, args)
        written = write_units(args.write_systemd, dump_config(settings_of(build_parser(), args)),
                              options.mps == "on" or (options.mps == "auto" and shares_a_gpu(specs)))
    except LaunchError as exc:
        print(f"epd-launch: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"epd-launch: error: {exc.filename}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    names = " ".join(p.name for p in written)
    print(f"epd-launch: wrote {names} into {args.write_systemd}; install: copy epd.yaml to /etc/epd/ and the "
          "units to /etc/systemd/system/, then systemctl daemon-reload && systemctl enable --now epd")
    return 0


def shares_a_gpu(specs) -> bool:
    devices = [s.device for s in specs if s.role != "proxy" and s.device.startswith("cuda")]
    return len(devices) != len(set(devices))


def plan_box(options: LaunchOptions, facts, args: argparse.Namespace):
    """The stages, and the one line saying where they go and why."""
    model = options.model or facts.builtin_model
    model_id = options.model_id or (model.name if model else "")
    workload = PlanWorkload(args.images, args.image_size, args.input_len, args.output_len, args.slo_ttft_ms,
                            args.slo_tpot_ms)
    choice = choose_placement(options, facts, model_id, workload)
    specs = plan_stages(options, facts, choice.placement)
    models = [s for s in specs if s.role != "proxy"]
    gpus = plan_gpus(options, facts) if uses_cuda(options, facts) else ()
    where = describe([s.instance for s in models], [s.device for s in models], gpus)
    return specs, f"epd-launch: placement {choice.placement} ({choice.reason}): {where}"


if __name__ == "__main__":
    sys.exit(main())
