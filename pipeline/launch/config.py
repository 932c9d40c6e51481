"""epd-launch's config file: YAML, as `vllm serve --config` takes it.

The keys are the launcher's long flags, without the dashes in front (`max-num-seqs` or `max_num_seqs`).
Each value is typed by `LaunchFile`, a msgspec schema. Checking it names the key, what was wanted and what came;
an unknown key is refused. The file becomes command-line flags put before the real ones. The command line
overrides the file for single flags, and adds to it for the repeatable ones (`stage-arg`).
"""

from __future__ import annotations

import json
import typing
from pathlib import Path
from typing import Literal

import msgspec
import yaml

from pipeline.models.reasoning_parsers import REASONING_PARSERS
from pipeline.launch.vllm_other_flags import ALL as OTHER_FLAGS
from pipeline.launch.vllm_other_flags import SWITCH, dest_of
from pipeline.processing.content_format import CONTENT_FORMATS

Mode = Literal["epd", "aggregated"]
Device = Literal["auto", "cpu", "cuda"]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
Placement = Literal["auto", "colocated", "dedicated"]
Mps = Literal["auto", "on", "off"]
EncoderPriority = Literal["normal", "below-normal"]
EncodeFallback = Literal["off", "local"]
SchedulingPolicy = Literal["fcfs", "priority"]
ReasoningParser = Literal[tuple(REASONING_PARSERS)]
ContentFormat = Literal[CONTENT_FORMATS]
ENCODE_FALLBACKS = typing.get_args(EncodeFallback)


class ConfigError(ValueError):
    """A config file that cannot be used; the message names the key."""


class _LaunchKeys(msgspec.Struct, forbid_unknown_fields=True, rename="kebab", omit_defaults=True):
    """Every key a config file may have: the flags of `epd-launch --help`
    (LaunchFile adds those of vllm_other_flags.py's tables)."""

    encoders: int | None = None
    generators: int | None = None
    model: str | None = None
    random_weights: str | None = None
    model_id: str | None = None
    host: str | None = None
    port: int | None = None
    mode: Mode | None = None
    encode_fallback: EncodeFallback | None = None
    dtype: Dtype | None = None
    device: Device | None = None
    gpus: list[int] | None = None
    placement: Placement | None = None
    mps: Mps | None = None
    encoder_sm_percent: int | None = None
    encoder_priority: EncoderPriority | None = None
    encoder_yield_ms: float | None = None
    profile: str | None = None
    images: int | None = None
    image_size: str | None = None
    input_len: int | None = None
    output_len: int | None = None
    slo_ttft_ms: float | None = None
    slo_tpot_ms: float | None = None
    served_model_name: list[str] | str | None = None
    api_key: str | None = None
    chat_template: str | None = None
    allowed_origins: list[str] | None = None
    responses_store_mb: float | None = None
    gpu_memory_utilization: float | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int | None = None
    max_model_len: int | None = None
    enforce_eager: bool | None = None
    optimization_level: Literal[0, 1, 2, 3] | None = None
    enable_prefix_caching: bool | None = None
    disable_log_stats: bool | None = None
    disable_log_requests: bool | None = None
    enable_log_requests: bool | None = None
    scheduling_policy: SchedulingPolicy | None = None
    seed: int | None = None
    max_logprobs: int | None = None
    limit_mm_per_prompt: dict[str, int] | None = None
    mm_processor_kwargs: dict[str, int] | None = None
    prefill_pacing_ms: float | None = None
    prefill_pacing_max_hold_ms: float | None = None
    generation_config: str | None = None
    override_generation_config: dict[str, float | int] | None = None
    enable_prompt_tokens_details: bool | None = None
    trust_request_chat_template: bool | None = None
    exclude_tools_when_tool_choice_none: bool | None = None
    chat_template_content_format: ContentFormat | None = None
    return_tokens_as_token_ids: bool | None = None
    enable_force_include_usage: bool | None = None
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: Literal[0, 1, 2] | None = None
    allowed_local_media_path: str | None = None
    allowed_media_domains: list[str] | None = None
    trust_remote_code: bool | None = None
    tensor_parallel_size: int | None = None
    pipeline_parallel_size: int | None = None
    data_parallel_size: int | None = None
    kv_cache_dtype: str | None = None
    load_format: str | None = None
    enable_chunked_prefill: bool | None = None
    disable_uvicorn_access_log: bool | None = None
    enable_auto_tool_choice: bool | None = None
    tool_call_parser: str | None = None
    reasoning_parser: ReasoningParser | None = None
    default_chat_template_kwargs: dict[str, object] | None = None
    log_dir: str | None = None
    log_level: Literal["debug", "info", "warning", "error"] | None = None
    log_format: Literal["text", "json"] | None = None
    stage_arg: list[str] | None = None
    ready_timeout: float | None = None
    drain_timeout: float | None = None
    stop_timeout: float | None = None
    allowed_methods: list[str] | None = None
    allowed_headers: list[str] | None = None
    allow_credentials: bool | None = None
    enable_server_load_tracking: bool | None = None
    kv_cache_memory_bytes: int | str | None = None
    revision: str | None = None
    download_dir: str | None = None
    structured_outputs_config: dict[str, str] | None = None
    cpu_offload_gb: float | None = None
    api_server_count: int | None = None
    tokenizer_mode: str | None = None
    model_impl: str | None = None
    config_format: str | None = None
    logprobs_mode: str | None = None
    distributed_executor_backend: str | None = None
    response_role: str | None = None
    guided_decoding_backend: str | None = None
    prefix_caching_hash_algo: str | None = None
    max_num_partial_prefills: int | None = None
    max_long_partial_prefills: int | None = None
    long_prefill_token_threshold: int | None = None


# The table-driven flags' keys (accepted as they are, or refused by name when
# the file becomes flags): a switch's true, or the one value as written.
LaunchFile = msgspec.defstruct(
    "LaunchFile", [(dest_of(flag), (bool if takes == SWITCH else str | int | float) | None, None)
                   for flag, takes, _ in OTHER_FLAGS],
    bases=(_LaunchKeys,), module=__name__)


def load_config(path: Path) -> LaunchFile:
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"--config {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config {path}: not YAML: {exc}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"--config {path}: want a mapping of keys to values, got {type(raw).__name__}")
    keys = {str(key).replace("_", "-"): value for key, value in raw.items()}
    try:
        return msgspec.convert(keys, LaunchFile, strict=False)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"--config {path}: {explain(str(exc))}") from None


def explain(message: str) -> str:
    """msgspec's message, with the allowed values where the key takes a fixed
    set (and without `| null`: every key may be left out, none set to null)."""
    message = message.replace(" | null`", "`")
    key = message.rpartition("$.")[2].rstrip("`")
    field = key.replace("-", "_")
    hint = typing.get_type_hints(LaunchFile).get(field)
    allowed = [a for arg in typing.get_args(hint) for a in typing.get_args(arg)] if hint is not None else []
    if allowed and all(isinstance(a, str) for a in allowed):
        return f"{message} (allowed: {', '.join(allowed)})"
    return message


NEGATABLE = ("enable_prefix_caching", "enable_chunked_prefill")


def as_flags(config: LaunchFile) -> list[str]:
    """The file's settings as epd-launch flags, in the schema's order."""
    flags: list[str] = []
    for field in config.__struct_fields__:
        value = getattr(config, field)
        if value is None:
            continue
        flag = "--" + field.replace("_", "-")
        if field in NEGATABLE:   # on by default: false is the --no- flag
            flags.append(flag if value else f"--no-{flag[2:]}")
        elif isinstance(value, bool):   # a switch: the flag alone, or nothing
            flags += [flag] if value else []
        elif field == "stage_arg":
            flags += [f"--stage-arg={item}" for item in value]
        elif field in ("served_model_name", "allowed_media_domains"):
            flags += [flag, *([value] if isinstance(value, str) else value)]
        elif field == "gpus":
            flags.append(f"{flag}={','.join(str(g) for g in value)}")
        elif field in ("allowed_origins", "limit_mm_per_prompt", "mm_processor_kwargs", "default_chat_template_kwargs",
                       "override_generation_config", "allowed_methods", "allowed_headers", "structured_outputs_config"):
            flags.append(f"{flag}={json.dumps(value)}")
        else:
            flags.append(f"{flag}={value}")
    return flags


def expand_config(argv: list[str]) -> list[str]:
    """argv with `--config FILE` replaced by the file's flags, put first."""
    for i, arg in enumerate(argv):
        if arg == "--config" or arg.startswith("--config="):
            if arg == "--config":
                if i + 1 == len(argv):
                    raise ConfigError("--config: expected a file")
                path, rest = argv[i + 1], argv[:i] + argv[i + 2:]
            else:
                path, rest = arg.partition("=")[2], argv[:i] + argv[i + 1:]
            return as_flags(load_config(Path(path))) + expand_config(rest)
    return argv


NOT_IN_FILE = ("config", "write_systemd", "log_dir")   # flags about this run, not the box's settings


def settings_of(parser, args) -> dict:
    """The settings of parsed `args` that differ from the parser's defaults,
    as a config file's keys and values (the inverse of as_flags)."""
    out = {}
    for field in LaunchFile.__struct_fields__:
        value = getattr(args, field, None)
        if field in NOT_IN_FILE or value is None or value == parser.get_default(field):
            continue
        if field == "stage_arg":
            value = [f"{role}={arg}" for role, arg in value]
        elif field == "image_size":
            value = f"{value[0]}x{value[1]}"
        elif field in ("allowed_origins", "allowed_methods", "allowed_headers"):
            value = json.loads(value)
        elif isinstance(value, tuple):
            value = list(value)
        elif isinstance(value, Path):
            value = str(value.resolve())
        out[field.replace("_", "-")] = value
    return out


def dump_config(settings: dict) -> str:
    return yaml.safe_dump(settings, sort_keys=False, default_flow_style=None)
