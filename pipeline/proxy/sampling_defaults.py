"""The checkpoint's own sampling defaults (generation_config.json), applied
to every request that leaves a setting unset, as the common servers do by
default (`--generation-config auto`; `vllm` turns them off), with
`--override-generation-config`'s values over them."""

from __future__ import annotations

import json
import math
from pathlib import Path

from pipeline.arg_parser import json_object

FILE = "generation_config.json"
# generation_config.json key -> the request field it is the default of.
KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(setting: str, model_dir: Path, overrides: dict | None = None) -> dict[str, float | int]:
    """setting: "auto" (the model folder's file), "vllm" (none), or a folder
    holding a generation_config.json; overrides (vLLM's
    --override-generation-config): keys of that file whose values replace
    or add to its own, under any setting. ValueError for an unreadable
    file, an unknown key or a value of the wrong kind, naming it."""
    out = _from_file(setting, model_dir)
    for key, value in (overrides or {}).items():
        if key not in KEYS:
            raise ValueError(f"--override-generation-config: {key!r} is not one of {', '.join(KEYS)}")
        out[KEYS[key]] = _checked(key, value, "--override-generation-config")
    return out


def _from_file(setting: str, model_dir: Path) -> dict[str, float | int]:
    if setting == "vllm":
        return {}
    folder = Path(model_dir) if setting == "auto" else Path(setting)
    path = folder / FILE
    if not path.is_file():
        if setting != "auto":
            raise ValueError(f"--generation-config {setting}: no {FILE} there")
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read it: {exc}") from None
    return {field: _checked(key, raw[key], str(path)) for key, field in KEYS.items() if raw.get(key) is not None}


def _checked(key: str, value, where: str) -> float | int:
    integral = key in ("top_k", "max_new_tokens")
    if isinstance(value, bool) or not isinstance(value, int if integral else (int, float)) \
            or not math.isfinite(value):
        raise ValueError(f"{where}: {key} must be {'an integer' if integral else 'a number'}, got {value!r}")
    return value


def generation_overrides_arg(text: str) -> dict:
    """--override-generation-config's JSON object, e.g. '{"temperature": 0.7}'."""
    return json_object(text, '{"temperature": 0.7}')
