"""The proxy process: `python -m stages.proxy --port 8000 --encoders ADDR --generators ADDR ...`.

Speaks the OpenAI HTTP API; per request it fetches and hashes the images,
renders and tokenizes the prompt, then sends the encode jobs and the generate
request at the same time. SIGTERM or SIGINT stops it: it refuses new
connections and gives the requests in flight --drain-timeout to finish.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

import zmq.asyncio
from aiohttp import web

from pipeline import transport
from pipeline.arg_parser import OneLineParser
from pipeline.hashing import media_salt
from pipeline.launcher_watch import LauncherWatch, drain_when_launcher_gone, remove_own_files
from pipeline.logs import add_log_flags, setup_logging
from pipeline.models.errors import ModelLoadError
from pipeline.models.loader import load_config
from pipeline.models.tiny import default_model_dir
from pipeline.processing.chat_template import is_template_text
from pipeline.processing.content_format import CONTENT_FORMATS
from pipeline.processing.image_config import add_mm_processor_kwargs_flag
from pipeline.processing.media_prompt import video_tokens_of
from pipeline.processing.processor import Processor
from pipeline.proxy.access import AccessPolicy
from pipeline.proxy.api_types import template_kwargs_arg
from pipeline.proxy.dispatcher import ENCODE_FALLBACKS, Dispatcher
from pipeline.proxy.media_fetch import FetchPolicy
from pipeline.proxy.reasoning import PARSERS, reasoning_parser
from pipeline.proxy.requests import ModelInfo
from pipeline.proxy.sampling_defaults import generation_overrides_arg, sampling_defaults
from pipeline.proxy.server import ProxyApp
from pipeline.proxy.tls import add_tls_flags, check_tls_flags, server_context
from pipeline.sampling_params import MAX_TOP_LOGPROBS, max_logprobs_of
from pipeline.models.hub_cache import model_dir_arg


# After the drain has ended every request: the seconds their handlers get to
# write the last bytes (to slow clients too) before aiohttp cancels them.
HANDLER_GRACE_S = 5.0


def _addresses(values: list[str]) -> list[str]:
    return [a for v in values for a in v.split(",") if a]


def _add_answer_flags(p: argparse.ArgumentParser) -> None:
    """The flags that shape answers: prompts, sampling defaults, reasoning, logprobs, usage."""
    p.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                   help="sampling defaults for unset request fields: auto (the model's generation_config.json), "
                   "vllm (none), or a folder holding one")
    p.add_argument("--override-generation-config", type=generation_overrides_arg, default={}, metavar="JSON",
                   help="generation_config.json keys over the chosen defaults, e.g. '{\"temperature\": 0.7}' "
                   "(vLLM's flag; with --generation-config vllm, these alone)")
    p.add_argument("--chat-template", metavar="FILE|TEMPLATE",
                   help="a Jinja chat template (a file, or the template itself) instead of the checkpoint's, e.g. "
                        "one that takes tools for a checkpoint whose own does not")
    p.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                   help="a chat with tool_choice none renders no tools into its prompt (vLLM's flag)")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="a request may bring its own chat_template (vLLM's flag; without it such a request is a 400)")
    p.add_argument("--chat-template-content-format", choices=CONTENT_FORMATS, default="auto",
                   help="how the chat template takes a message's content: openai (a list of parts), string (one "
                   "string: parts flattened) or auto (openai if the template loops over content; vLLM's flag)")
    p.add_argument("--default-chat-template-kwargs", type=template_kwargs_arg, default={}, metavar="JSON",
                   help="template variables for every chat, e.g. '{\"enable_thinking\": false}'; a request's "
                   "chat_template_kwargs override them (vLLM's flag)")
    p.add_argument("--reasoning-parser", choices=PARSERS, metavar="|".join(PARSERS),
                   help="a thinking model's chat answers carry its reasoning (written up to </think>) apart from "
                   "the content, in `reasoning`; a grammar holds only the content (vLLM's flag)")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="usage carries prompt_tokens_details.cached_tokens: the prompt's tokens whose KV the "
                   "prefix cache held")
    p.add_argument("--max-logprobs", type=int, default=MAX_TOP_LOGPROBS, metavar="N",
                   help="the most top logprobs a request may ask for (-1: the whole vocabulary; give the "
                   f"generators the same), as vLLM's flag (default: {MAX_TOP_LOGPROBS})")
    p.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help="logprobs name tokens 'token_id:N' unless a request says otherwise (vLLM's flag)")
    p.add_argument("--enable-force-include-usage", action="store_true",
                   help="every stream ends with a usage chunk, whatever its stream_options (vLLM's flag)")
    p.add_argument("--responses-store-mb", type=float, default=64.0, metavar="MB",
                   help="memory for the Responses API's stored answers (store, previous_response_id), the "
                   "oldest dropped first; 0 stores none (default: 64)")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = OneLineParser(prog="stages.proxy", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--address", help="this proxy's inbox (default: ipc:// in the private run folder)")
    p.add_argument("--model", type=model_dir_arg, help="checkpoint folder (default: the built-in tiny model)")
    p.add_argument("--model-id", help="served model name and hash salt (default: the folder name)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the names clients may ask for, the first reported by default (default: --model-id)")
    p.add_argument("--api-key", default=os.environ.get("EPD_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on the API routes (default: $EPD_API_KEY; none)")
    p.add_argument("--api-key-all-routes", action="store_true",
                   help="the API key guards /health, /metrics and /version too")
    p.add_argument("--allowed-origins", type=_json_list, default=["*"], help='CORS origins, a JSON list')
    p.add_argument("--allowed-methods", type=_json_list, default=["*"], help="CORS methods, a JSON list")
    p.add_argument("--allowed-headers", type=_json_list, default=["*"], help="CORS headers, a JSON list")
    p.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    p.add_argument("--enable-server-load-tracking", action="store_true",
                   help="GET /load counts the generation requests in flight (vLLM's flag; 0 without it)")
    p.add_argument("--mode", choices=("epd", "aggregated"), default="epd")
    p.add_argument("--encoders", action="append", default=[], help="encoder inbox(es); repeatable or comma-separated")
    p.add_argument("--generators", action="append", default=[], help="generator inbox(es)")
    p.add_argument("--allowed-local-media-path", "--allow-file-dir", dest="allow_file_dir", action="append",
                   default=[], type=Path, metavar="DIR", help="a folder file:// media URLs may read; repeatable")
    p.add_argument("--allowed-media-domains", nargs="+", default=[], metavar="HOST",
                   help="the only hosts http(s) media URLs may name (these may be private addresses)")
    p.add_argument("--disable-http-media", action="store_true", help="refuse http(s):// media URLs")
    p.add_argument("--allow-http", action="store_true", help=argparse.SUPPRESS)   # the default now
    p.add_argument("--media-fetch-timeout", type=float, default=10.0, metavar="S",
                   help="seconds for one http(s) media fetch, redirects included")
    p.add_argument("--max-image-bytes", type=int, default=20 << 20)
    p.add_argument("--max-images", type=int, default=16, help="images per request")
    add_mm_processor_kwargs_flag(p)
    p.add_argument("--max-model-len", type=int, metavar="N",
                   help="prompt plus output tokens a request may have (default, and at most: the checkpoint's)")
    p.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                   help="the generators' (epd-launch passes both): with priority, requests may set a priority")
    _add_answer_flags(p)
    p.add_argument("--max-in-flight", type=int, default=1024, help="requests in flight before 503")
    p.add_argument("--drain-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGTERM, seconds the requests in flight get to finish; new connections are "
                   "refused meanwhile")
    p.add_argument("--encode-fallback", choices=ENCODE_FALLBACKS, default="off",
                   help="local: while no encoder is up, send the images' encode jobs to the generators, which "
                   "encode them themselves (start them with the same flag); off: they wait for an encoder")
    p.add_argument("--stage-timeout", type=float, default=3.0,
                   help="seconds without a stage's stats reply before it counts as down and its requests move")
    p.add_argument("--orphan-timeout", type=float, default=60.0, metavar="S",
                   help="seconds the requests of a generator that looks down wait, while no other generator is "
                   "up, for it to answer again, restart, or another to come up; then they fail with 503")
    add_tls_flags(p)
    add_log_flags(p)
    args = p.parse_args(argv)
    check_tls_flags(p, args)
    args.encoders, args.generators = _addresses(args.encoders), _addresses(args.generators)
    if not args.generators:
        p.error("at least one --generators address is required")
    if args.mode == "epd" and not args.encoders:
        p.error("--mode epd needs at least one --encoders address")
    if args.mode == "aggregated" and args.encode_fallback != "off":
        p.error("--encode-fallback is for --mode epd (aggregated generators encode every image themselves)")
    if not 0 < args.port < 65536:
        p.error("--port must be in 1..65535")
    if not args.drain_timeout >= 0:   # also false for nan
        p.error("--drain-timeout must be >= 0 seconds")
    if not args.stage_timeout > 0.5:    # stats are asked for every 0.5 s
        p.error("--stage-timeout must be more than 0.5 seconds")
    if not args.orphan_timeout >= 0:
        p.error("--orphan-timeout must be >= 0 seconds")
    if args.max_logprobs < -1:
        p.error("--max-logprobs must be -1 (the whole vocabulary) or at least 0")
    if args.responses_store_mb < 0:
        p.error("--responses-store-mb must be >= 0 (0 stores none)")
    return args


def _json_list(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, e.g. '[\"*\"]', got {text!r}")
    return value


def chat_template_arg(value: str | None) -> str | None:
    """--chat-template's template: the value itself when it is one, else the
    text of the file it names (vllm serve takes either)."""
    if value is None:
        return None
    if is_template_text(value):
        return value
    try:
        return Path(value).read_text()
    except OSError as exc:
        raise ValueError(f"--chat-template {value}: {exc.strerror or exc}") from None


def model_info(args: argparse.Namespace) -> ModelInfo:
    """What the proxy knows of the model these flags serve: its processor, limits and defaults."""
    model_dir = args.model or default_model_dir()
    family, config = load_config(model_dir)
    spec = family.spec(config)
    processor = Processor.from_checkpoint(model_dir, spec.image_token_id, video_tokens_of(spec),
                                          chat_template_arg(args.chat_template), args.mm_processor_kwargs)
    model_id = args.model_id or Path(model_dir).name
    if args.max_model_len is not None and not 1 <= args.max_model_len <= spec.language.max_context:
        raise ValueError(f"--max-model-len {args.max_model_len}: this checkpoint takes 1 to "
                         f"{spec.language.max_context} tokens")
    return ModelInfo(model_id, processor, args.max_model_len or spec.language.max_context,
                      media_salt(model_id, processor.image_config.settings_key()),
                      aggregated=args.mode == "aggregated", max_images=args.max_images,
                      served_names=tuple(args.served_model_name or ()),
                      defaults=sampling_defaults(args.generation_config, model_dir, args.override_generation_config),
                      trust_request_chat_template=args.trust_request_chat_template,
                      scheduling_policy=args.scheduling_policy,
                      reasoning=reasoning_parser(args.reasoning_parser, processor.tokenizer),
                      max_logprobs=max_logprobs_of(args.max_logprobs, processor.tokenizer.vocab_size),
                      template_kwargs=args.default_chat_template_kwargs,
                      tokens_as_ids=args.return_tokens_as_token_ids,
                      content_format=args.chat_template_content_format,
                      exclude_tools_when_none=args.exclude_tools_when_tool_choice_none)


def build_app(args: argparse.Namespace) -> web.Application:
    model = model_info(args)
    address = args.address or transport.ipc_address(f"proxy-{args.port}")
    dispatcher = Dispatcher(zmq.asyncio.Context(), address, args.encoders, args.generators,
                            args.mode == "aggregated", args.max_in_flight, args.stage_timeout,
                            encode_fallback=args.encode_fallback, orphan_timeout=args.orphan_timeout)
    policy = FetchPolicy(args.max_image_bytes, tuple(args.allow_file_dir), not args.disable_http_media,
                         args.media_fetch_timeout, tuple(d.lower() for d in args.allowed_media_domains))
    access = AccessPolicy(args.api_key or None, args.api_key_all_routes, args.allowed_origins,
                          args.allowed_methods, args.allowed_headers, args.allow_credentials)
    app = ProxyApp(dispatcher, model, policy, args.drain_timeout, access,
                   prompt_tokens_details=args.enable_prompt_tokens_details,
                   force_usage=args.enable_force_include_usage,
                   responses_store_bytes=int(args.responses_store_mb * (1 << 20)),
                   load_tracking=args.enable_server_load_tracking).build()
    app.cleanup_ctx.append(lambda app: _launcher_watch(address))
    return app


async def _launcher_watch(address: str):
    """While the proxy runs: drain and exit if the launcher that started it dies."""
    watch = LauncherWatch()
    task = asyncio.create_task(drain_when_launcher_gone(watch))
    yield
    task.cancel()
    remove_own_files(watch, address)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    setup_logging(args.log_level, args.log_format, args.disable_log_stats, args.disable_log_requests)
    transport.install_event_loop()
    try:
        tls = server_context(args)   # before anything binds: a bad key file stops it at once
        app = build_app(args)
    except zmq.ZMQError as exc:
        print(f"stages.proxy: error: cannot bind its inbox: {exc}", file=sys.stderr)
        return 1
    except (ModelLoadError, ValueError, OSError) as exc:   # OSError: a file, or TLS's (ssl.SSLError)
        print(f"stages.proxy: error: {exc}", file=sys.stderr)
        return 1
    try:
        # aiohttp's graceful exit stops listening, then runs our drain (on
        # shutdown), which ends every request; HANDLER_GRACE_S is for their
        # handlers to write those last words before aiohttp cancels them.
        # handler_cancellation: a client that hangs up cancels its handler at
        # once, which aborts its request in the generators.
        web.run_app(app, host=args.host, port=args.port, print=None, access_log=None,
                    shutdown_timeout=HANDLER_GRACE_S, handler_cancellation=True, ssl_context=tls)
    except OSError as exc:   # the HTTP port is taken (or not ours to bind)
        print(f"stages.proxy: error: cannot serve on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
