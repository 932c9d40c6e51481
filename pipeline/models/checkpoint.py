"""Reading a local Hugging Face checkpoint folder: config.json and safetensors.

Weights are streamed tensor by tensor from the safetensors files straight into
a model built on the meta device, so a checkpoint is never held twice in memory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from pipeline.models.errors import ModelLoadError
from pipeline.models.registry import ModelFamily

INDEX_FILE = "model.safetensors.index.json"

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def read_config(model_dir: Path) -> dict[str, Any]:
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"model folder not found: {model_dir}")
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"no config.json in model folder {model_dir}")
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{path} is not a JSON object")
    return raw


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files: those named by the shard index when there is one,
    else every *.safetensors in the folder."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"cannot read shard index {index}: {exc}") from exc
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"shard index names missing files: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in model folder {model_dir}")
    return files


def load_weights(model: torch.nn.Module, family: ModelFamily, config: Any, model_dir: Path,
                 device: torch.device, prefix: str = "") -> None:
    """Copy every checkpoint tensor into `model` (already materialised on
    `device`, in its final dtype). Missing or unexpected tensors are an error
    that names them. With `prefix`, `model` is that part of the full model
    (e.g. "visual." for an encoder process) and other tensors are skipped."""
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    unexpected: list[str] = []
    for path in safetensors_files(Path(model_dir)):
        try:
            handle = safe_open(str(path), framework="pt", device="cpu")
        except Exception as exc:  # safetensors raises its own untyped errors
            raise ModelLoadError(f"cannot open weights {path.name}: {exc}") from exc
        with handle as f:
            for name in f.keys():
                target = family.canonical_name(name, config)
                if target is None or not target.startswith(prefix):
                    continue
                target = target[len(prefix):]
                param = params.get(target)
                if param is None:
                    unexpected.append(name)
                    continue
                tensor = f.get_tensor(name)
                if tuple(tensor.shape) != tuple(param.shape):
                    raise ModelLoadError(
                        f"tensor {name} has shape {tuple(tensor.shape)}, "
                        f"the config implies {tuple(param.shape)}")
                with torch.no_grad():
                    param.copy_(tensor.to(device=device, dtype=param.dtype))
                loaded.add(target)
    missing = sorted(set(params) - loaded)
    if missing or unexpected:
        raise ModelLoadError(_describe_mismatch(missing, unexpected))


def _describe_mismatch(missing: list[str], unexpected: list[str]) -> str:
    def head(names: list[str]) -> str:
        shown = ", ".join(names[:8])
        return shown + (f" (+{len(names) - 8} more)" if len(names) > 8 else "")

    parts = []
    if missing:
        parts.append(f"{len(missing)} missing tensors: {head(missing)}")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected tensors: {head(unexpected)}")
    return "checkpoint does not match the model: " + "; ".join(parts)
