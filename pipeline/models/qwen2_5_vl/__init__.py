"""The Qwen2.5-VL family."""

from __future__ import annotations

from typing import Any

import torch

from pipeline.models.qwen2_5_vl.config import Qwen25VLConfig, model_spec, parse_config
from pipeline.models.qwen2_5_vl.model import Qwen25VL
from pipeline.models.registry import ModelFamily, register
from pipeline.models.spec import ModelSpec

# Checkpoints written by some transformers 4.x releases nest the language
# model and the vision tower under `model.`; hub checkpoints do not.
_PREFIX_ALIASES = (("model.language_model.", "model."), ("model.visual.", "visual."))


class Qwen25VLFamily(ModelFamily):
    name = "qwen2_5_vl"
    model_types = ("qwen2_5_vl",)
    architectures = ("Qwen2_5_VLForConditionalGeneration",)

    def parse_config(self, raw: dict[str, Any]) -> Qwen25VLConfig:
        return parse_config(raw)

    def build(self, config: Qwen25VLConfig, dtype: torch.dtype) -> Qwen25VL:
        return Qwen25VL(config).to(dtype)

    def spec(self, config: Qwen25VLConfig) -> ModelSpec:
        return model_spec(config)

    def canonical_name(self, checkpoint_name: str, config: Qwen25VLConfig) -> str | None:
        if checkpoint_name == "lm_head.weight" and config.text.tie_word_embeddings:
            return None  # some tied checkpoints still store the shared matrix twice
        for old, new in _PREFIX_ALIASES:
            if checkpoint_name.startswith(old):
                return new + checkpoint_name[len(old):]
        return checkpoint_name


FAMILY = register(Qwen25VLFamily())

__all__ = ["FAMILY", "Qwen25VL", "Qwen25VLConfig"]
