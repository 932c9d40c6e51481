"""Model families, chosen by a checkpoint's `config.json`.

A family knows how to read its config, say what the serving code may know
of it (a ModelSpec), build its modules, and name its checkpoint tensors. A family is one package under pipeline/models/ that
registers itself when imported; the registry imports every such package on
first use, so adding a family adds a folder and edits no list here or
anywhere else.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from abc import ABC, abstractmethod
from typing import Any

import torch

from pipeline.models.errors import UnsupportedModelError
from pipeline.models.spec import ModelSpec


class ModelFamily(ABC):
    """One architecture family.

    `model_types` / `architectures` are matched against config.json. `build`
    returns an uninitialised model (the loader fills its weights); it must not
    allocate real memory when called under `torch.device("meta")`.
    """

    name: str
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]

    @abstractmethod
    def parse_config(self, raw: dict[str, Any]) -> Any:
        """Typed, validated config; raises ValueError naming the bad field."""

    @abstractmethod
    def build(self, config: Any, dtype: torch.dtype) -> torch.nn.Module:
        """The full model, parameters in `dtype`."""

    @abstractmethod
    def spec(self, config: Any) -> ModelSpec:
        """What the serving code may know of this config (spec.py)."""

    @abstractmethod
    def canonical_name(self, checkpoint_name: str, config: Any) -> str | None:
        """Map a tensor name found in a checkpoint to the model's parameter
        name; None means 'known, not needed' (skipped silently)."""


_FAMILIES: list[ModelFamily] = []


def register(family: ModelFamily) -> ModelFamily:
    _FAMILIES.append(family)
    return family


def families() -> tuple[ModelFamily, ...]:
    _import_builtin_families()
    return tuple(_FAMILIES)


def family_for(raw_config: dict[str, Any]) -> ModelFamily:
    """The family that serves this config.json, by `model_type`, then by
    `architectures`; an UnsupportedModelError lists what is supported."""
    model_type = raw_config.get("model_type")
    archs = raw_config.get("architectures") or []
    for family in families():
        if model_type in family.model_types:
            return family
    for family in families():
        if any(a in family.architectures for a in archs):
            return family
    supported = ", ".join(t for f in families() for t in f.model_types)
    raise UnsupportedModelError(
        f"unsupported architecture: model_type={model_type!r} architectures={archs!r}; "
        f"supported model types: {supported}"
    )


@functools.cache
def _import_builtin_families() -> None:
    """Import every package under pipeline/models/ (each family's folder);
    lazily, so that `registry` has no import cycle with the families."""
    import pipeline.models as models

    for module in pkgutil.iter_modules(models.__path__, prefix=f"{models.__name__}."):
        if module.ispkg:
            importlib.import_module(module.name)
