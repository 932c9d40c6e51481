"""Load a model from a local checkpoint folder onto a device."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.models.checkpoint import load_weights, parse_dtype, read_config
from pipeline.models.errors import ModelLoadError
from pipeline.models.registry import ModelFamily, family_for


@dataclass(frozen=True)
class LoadedModel:
    family: ModelFamily
    config: Any
    model: torch.nn.Module
    model_dir: Path
    dtype: torch.dtype
    device: torch.device


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("device 'cuda' requested but no CUDA device is available")
    return device


def load_config(model_dir: Path) -> tuple[ModelFamily, Any]:
    raw = read_config(Path(model_dir))
    family = family_for(raw)
    try:
        return family, family.parse_config(raw)
    except ValueError as exc:
        raise ModelLoadError(f"invalid config.json in {model_dir}: {exc}") from exc


def load_model(model_dir: Path, dtype: str = "float32", device: str = "cpu",
               part: str | None = None) -> LoadedModel:
    """Build the model on the meta device (no memory), materialise it (or
    only its submodule `part`, e.g. "visual" for an encoder) on the target
    device, then stream the checkpoint's tensors into it."""
    model_dir = Path(model_dir)
    torch_dtype = parse_dtype(dtype)
    target = resolve_device(device)
    family, config = load_config(model_dir)
    model = materialize(family, config, torch_dtype, target, part)
    load_weights(model, family, config, model_dir, target, prefix=f"{part}." if part else "")
    model.eval().requires_grad_(False)
    return LoadedModel(family, config, model, model_dir, torch_dtype, target)


def materialize(family: ModelFamily, config: Any, dtype: torch.dtype, device: torch.device,
                part: str | None = None) -> torch.nn.Module:
    """The model (or its submodule `part`) with uninitialised memory on
    `device`: built on the meta device first, so nothing is allocated twice."""
    with torch.device("meta"):
        model = family.build(config, dtype)
    if part is not None:
        model = model.get_submodule(part)
    model = model.to_empty(device=device)
    model.reset_buffers()
    return model
