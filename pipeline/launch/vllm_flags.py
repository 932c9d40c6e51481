"""`vllm serve` flags that epd-launch takes so that a vLLM command line or
unit carries over: those the proxy acts on are passed to it; the rest are
accepted only where their meaning already holds here, and refused in one
line otherwise (a flag is never silently dropped)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pipeline.arg_parser import human_readable_int, json_object
from pipeline.launch.vllm_fixed_flags import add_fixed_flags, check_fixed_flags
from pipeline.launch.vllm_other_flags import add_other_flags, check_other_flags
from pipeline.processing.content_format import CONTENT_FORMATS
from pipeline.proxy.api_types import template_kwargs_arg
from pipeline.proxy.reasoning import PARSERS
from pipeline.proxy.sampling_defaults import generation_overrides_arg
from pipeline.proxy.tls import add_tls_flags, check_tls_flags

# The tool-call format the proxy parses (pipeline/proxy/tool_parser.py): Hermes's
# <tool_call> blocks, what vLLM's hermes parser reads.
TOOL_CALL_PARSERS = ("hermes",)
# vLLM's structured output backends that name what enforces grammars here: llguidance.
GRAMMAR_BACKENDS = ("auto", "guidance")


def add_vllm_flags(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("more of vllm serve's flags, with the same meaning")
    group.add_argument("--generation-config", metavar="auto|vllm|DIR",
                       help="sampling defaults for unset request fields: auto (the checkpoint's "
                       "generation_config.json, the default), vllm (none), or a folder holding one")
    group.add_argument("--override-generation-config", type=generation_overrides_arg, metavar="JSON",
                       help="generation_config.json keys over the chosen defaults, e.g. '{\"temperature\": 0.7}'")
    group.add_argument("--allowed-local-media-path", metavar="DIR",
                       help="a folder that file:// media URLs may read (default: none may)")
    group.add_argument("--allowed-media-domains", nargs="+", metavar="HOST",
                       help="the only hosts that http(s) media URLs may name")
    group.add_argument("--enable-prompt-tokens-details", action="store_true",
                       help="usage carries prompt_tokens_details.cached_tokens (prompt tokens from the prefix cache)")
    group.add_argument("--return-tokens-as-token-ids", action="store_true",
                       help="logprobs name tokens 'token_id:N' unless a request says otherwise")
    group.add_argument("--enable-force-include-usage", action="store_true",
                       help="every stream ends with a usage chunk, whatever its stream_options")
    group.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                       help="a chat with tool_choice none renders no tools into its prompt")
    group.add_argument("--trust-request-chat-template", action="store_true",
                       help="a request may bring its own chat_template (without it, such a request is a 400)")
    group.add_argument("--chat-template-content-format", choices=CONTENT_FORMATS,
                       help="how the chat template takes a message's content: openai (parts), string (parts "
                       "flattened) or auto (openai if the template loops over content, the default)")
    group.add_argument("--trust-remote-code", action="store_true",
                       help="accepted: no checkpoint's own code is ever run here (the model code is this "
                       "package's), so there is nothing to trust")
    add_fixed_flags(group)
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="accepted: tool calls are always parsed (tool_choice auto is the default with tools)")
    group.add_argument("--tool-call-parser", metavar="NAME",
                       help=f"{', '.join(TOOL_CALL_PARSERS)} only: the format the proxy parses")
    group.add_argument("--default-chat-template-kwargs", type=template_kwargs_arg, metavar="JSON",
                       help="template variables for every chat, e.g. '{\"enable_thinking\": false}' (a request's "
                       "chat_template_kwargs override them)")
    group.add_argument("--reasoning-parser", choices=PARSERS, metavar="|".join(PARSERS),
                       help="chat answers carry the reasoning of a thinking model apart from the content "
                       "(in `reasoning`); structured output holds only the content")
    add_tls_flags(group)   # HTTPS, passed to the proxy (pipeline/proxy/tls.py)
    group.add_argument("--allowed-methods", type=_json_list, metavar="JSON",
                       help='CORS methods, a JSON list (default: ["*"])')
    group.add_argument("--allowed-headers", type=_json_list, metavar="JSON",
                       help='CORS headers, a JSON list (default: ["*"])')
    group.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    group.add_argument("--enable-server-load-tracking", action="store_true",
                       help="GET /load counts the API requests in flight (0 without this flag)")
    group.add_argument("--kv-cache-memory-bytes", type=human_readable_int, metavar="N",
                       help="each generator's KV cache size in bytes (e.g. 8G), instead of sizing it from "
                       "--gpu-memory-utilization")
    group.add_argument("--revision", metavar="REV",
                       help="a repo id's snapshot: a branch, tag or commit in the cache (default: main)")
    group.add_argument("--download-dir", metavar="DIR",
                       help="the Hugging Face cache folder to find a repo id in (nothing is downloaded)")
    group.add_argument("--structured-outputs-config", type=_grammar_config, metavar="JSON",
                       help=f"accepted with backend {' or '.join(GRAMMAR_BACKENDS)} only: grammars are enforced "
                       "by llguidance")
    add_other_flags(p)


def _json_list(text: str) -> str:
    """The text of a JSON list of strings, checked here and passed on as it is."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f'expected a JSON list of strings, e.g. \'["GET", "POST"]\', got {text!r}')
    return text


def optimization_level(text: str) -> int:
    """vllm serve's -O N. Its older forms (a compilation config's JSON, or
    dotted keys) name torch.compile settings that have no meaning here."""
    if text not in ("0", "1", "2", "3"):
        raise argparse.ArgumentTypeError(f"{text!r}: a level of 0, 1, 2 or 3 (no compilation config is taken: "
                                         "the generators capture CUDA graphs of their own steps; -O0 turns "
                                         "them off)")
    return int(text)


def _grammar_config(text: str) -> dict:
    value = json_object(text, '{"backend": "guidance"}')
    if set(value) - {"backend"} or value.get("backend", "auto") not in GRAMMAR_BACKENDS:
        raise argparse.ArgumentTypeError(f"{text}: only a backend of auto or guidance holds here (grammars are "
                                         "enforced by llguidance; request fields set the rest)")
    return value


def check_vllm_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """p.error, naming the flag, for a value whose meaning does not hold here."""
    check_fixed_flags(p, args)
    check_other_flags(p, args)
    check_tls_flags(p, args)
    if args.kv_cache_memory_bytes is not None and args.kv_cache_memory_bytes < 1 << 20:
        p.error(f"--kv-cache-memory-bytes {args.kv_cache_memory_bytes}: want at least 1 MiB (1M)")
    if args.ssl_cert_reqs == 2:
        p.error("--ssl-cert-reqs 2: the launcher's own /health check has no client certificate; "
                "use 1 (a certificate sent is checked) or start stages.proxy yourself")
    if args.tool_call_parser is not None and args.tool_call_parser not in TOOL_CALL_PARSERS:
        p.error(f"--tool-call-parser {args.tool_call_parser}: the proxy parses "
                f"{' or '.join(TOOL_CALL_PARSERS)} tool calls only")


def vllm_stage_flags(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(role, flag) for the ones the proxy or the generators act on."""
    out = []
    if args.kv_cache_memory_bytes is not None:   # whole MiB: the generators' unit
        out.append(("generator", f"--kv-cache-mib={args.kv_cache_memory_bytes >> 20}"))
    for name in ("allowed_methods", "allowed_headers"):
        if getattr(args, name) is not None:
            out.append(("proxy", f"--{name.replace('_', '-')}={getattr(args, name)}"))
    if args.generation_config is not None:
        out.append(("proxy", f"--generation-config={args.generation_config}"))
    if args.override_generation_config is not None:
        out.append(("proxy", f"--override-generation-config={json.dumps(args.override_generation_config)}"))
    if args.allowed_local_media_path is not None:
        out.append(("proxy", f"--allowed-local-media-path={args.allowed_local_media_path}"))
    if args.enable_prompt_tokens_details:
        out.append(("proxy", "--enable-prompt-tokens-details"))
    for name in ("trust_request_chat_template", "return_tokens_as_token_ids", "enable_force_include_usage",
                 "allow_credentials", "enable_server_load_tracking", "exclude_tools_when_tool_choice_none"):
        if getattr(args, name):
            out.append(("proxy", f"--{name.replace('_', '-')}"))
    if args.default_chat_template_kwargs is not None:
        out.append(("proxy", f"--default-chat-template-kwargs={json.dumps(args.default_chat_template_kwargs)}"))
    for name in ("reasoning_parser", "chat_template_content_format"):
        if getattr(args, name) is not None:
            out.append(("proxy", f"--{name.replace('_', '-')}={getattr(args, name)}"))
    for name in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):   # absolute: the proxy runs in its own folder
        if getattr(args, name):
            out.append(("proxy", f"--{name.replace('_', '-')}={Path(getattr(args, name)).resolve()}"))
    if args.ssl_cert_reqs is not None:
        out.append(("proxy", f"--ssl-cert-reqs={args.ssl_cert_reqs}"))
    if args.allowed_media_domains:   # nargs="+" on the proxy: one flag, then every host
        out += [("proxy", "--allowed-media-domains"), *(("proxy", host) for host in args.allowed_media_domains)]
    return out
