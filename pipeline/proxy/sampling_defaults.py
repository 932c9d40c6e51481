"""The checkpoint's own sampling defaults (generation_config.json), applied
to every request that leaves a setting unset, as the common servers do by
default (`--generation-config auto`; `vllm` turns them off)."""

from __future__ import annotations

import json
import math
from pathlib import Path

FILE = "generation_config.json"
# generation_config.json key -> the request field it is the default of.
KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
        "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(setting: str, model_dir: Path) -> dict[str, float | int]:
    """setting: "auto" (the model folder's file), "vllm" (none), or a folder
    holding a generation_config.json. ValueError for an unreadable file or
    a value of the wrong kind, naming it."""
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
    out = {}
    for key, field in KEYS.items():
        value = raw.get(key)
        if value is None:
            continue
        integral = key in ("top_k", "max_new_tokens")
        if isinstance(value, bool) or not isinstance(value, int if integral else (int, float)) \
                or not math.isfinite(value):
            raise ValueError(f"{path}: {key} must be {'an integer' if integral else 'a number'}, got {value!r}")
        out[field] = value
    return out
