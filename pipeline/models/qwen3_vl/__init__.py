"""The Qwen3-VL (dense) family."""

from __future__ import annotations

from typing import Any

import torch

from pipeline.models.qwen3_vl.config import Qwen3VLConfig, model_spec, parse_config
from pipeline.models.qwen3_vl.model import Qwen3VL
from pipeline.models.registry import ModelFamily, register
from pipeline.models.spec import ModelSpec

# Checkpoints nest both parts under `model.`; our module keeps the vision
# tower at `visual` (what an encoder process loads alone) and the language
# model at `model`, as the Qwen2.5-VL family does.
_PREFIXES = (("model.language_model.", "model."), ("model.visual.", "visual."))


class Qwen3VLFamily(ModelFamily):
    name = "qwen3_vl"
    model_types = ("qwen3_vl",)
    architectures = ("Qwen3VLForConditionalGeneration",)

    def parse_config(self, raw: dict[str, Any]) -> Qwen3VLConfig:
        return parse_config(raw)

    def build(self, config: Qwen3VLConfig, dtype: torch.dtype) -> Qwen3VL:
        return Qwen3VL(config).to(dtype)

    def spec(self, config: Qwen3VLConfig) -> ModelSpec:
        return model_spec(config)

    def canonical_name(self, checkpoint_name: str, config: Qwen3VLConfig) -> str | None:
        if checkpoint_name == "lm_head.weight" and config.text.tie_word_embeddings:
            return None  # a tied checkpoint may still store the shared matrix twice
        for old, new in _PREFIXES:
            if checkpoint_name.startswith(old):
                return new + checkpoint_name[len(old):]
        return checkpoint_name


FAMILY = register(Qwen3VLFamily())

__all__ = ["FAMILY", "Qwen3VL", "Qwen3VLConfig"]
