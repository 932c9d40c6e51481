"""Named real-size model shapes with random weights, made directly on the
target device: realistic loads on a GPU box with no checkpoint to download.

The configs (shape_configs.py) follow the published checkpoints' config.json;
the weights are random (normal, std 0.02; norms 1), so outputs are
meaningless but every matmul has the real size. shape_folder.py writes the
tokenizer and processor files that serve such a model.
"""

from __future__ import annotations

import torch

from pipeline.models.loader import LoadedModel, materialize
from pipeline.models.registry import ModelFamily, family_for
from pipeline.models.shape_configs import SHAPES, shape_config

__all__ = ["SHAPES", "PARTS", "random_model"]

# "visual": the vision tower alone (an encoder). "language": the whole model
# object with its vision tower left on the meta device (an EPD generator: it
# never encodes, so the tower costs no memory and any use of it fails loudly).
# None: everything (an aggregated generator).
PARTS = ("visual", "language", None)
_VISION_TOWER = "visual"


@torch.no_grad()
def random_model(shape: str, dtype: torch.dtype, device: torch.device, seed: int = 0,
                 part: str | None = None) -> LoadedModel:
    if part not in PARTS:
        raise ValueError(f"unknown model part {part!r}; known: visual, language, or None for all")
    raw = shape_config(shape)
    family = family_for(raw)
    config = family.parse_config(raw)
    if part == "language":
        model = _materialize_without_vision(family, config, dtype, device)
    else:
        model = materialize(family, config, dtype, device, part)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if param.is_meta:
            continue
        fixed = _norm_init(name)
        if fixed is None:
            param.normal_(0.0, 0.02, generator=gen)
        else:
            param.fill_(fixed)
    model.eval().requires_grad_(False)
    return LoadedModel(family, config, model, model_dir=None, dtype=dtype, device=device)


def _norm_init(name: str) -> float | None:
    """A norm's weight starts at 1 and its bias (LayerNorms have one) at 0, as
    in training; None for every other parameter."""
    module, _, kind = name.rpartition(".")
    module = module.rpartition(".")[2]
    if "norm" not in module and module != "ln_q":
        return None
    return 1.0 if kind == "weight" else 0.0


def _materialize_without_vision(family: ModelFamily, config, dtype: torch.dtype,
                                device: torch.device) -> torch.nn.Module:
    with torch.device("meta"):
        model = family.build(config, dtype)
    for name, child in model.named_children():
        if name != _VISION_TOWER:
            child.to_empty(device=device)
    model.reset_buffers()
    return model
