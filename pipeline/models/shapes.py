"""Named real-size model shapes with random weights, made directly on the
target device: realistic loads on a GPU box with no checkpoint to download.

The configs follow the published checkpoints' config.json (hub layout); the
weights are random (normal, std 0.02; norms 1), so outputs are meaningless
but every matmul has the real size.
"""

from __future__ import annotations

import torch

from pipeline.models.loader import LoadedModel, materialize
from pipeline.models.registry import family_for

_QWEN25_VL_3B = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
    "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
    "num_attention_heads": 16, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "max_position_embeddings": 128000,
    "tie_word_embeddings": True, "hidden_act": "silu", "eos_token_id": 151645,
    "image_token_id": 151655, "video_token_id": 151656,
    "vision_start_token_id": 151652, "vision_end_token_id": 151653,
    "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                      "out_hidden_size": 2048, "patch_size": 14, "spatial_merge_size": 2,
                      "temporal_patch_size": 2, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31],
                      "hidden_act": "silu", "in_chans": 3},
}

SHAPES = {"qwen2.5-vl-3b": _QWEN25_VL_3B}


@torch.no_grad()
def random_model(shape: str, dtype: torch.dtype, device: torch.device, seed: int = 0,
                 part: str | None = None) -> LoadedModel:
    if shape not in SHAPES:
        raise ValueError(f"unknown model shape {shape!r}; known: {', '.join(SHAPES)}")
    raw = SHAPES[shape]
    family = family_for(raw)
    config = family.parse_config(raw)
    model = materialize(family, config, dtype, device, part)
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight") or "norm1" in name or "norm2" in name or "ln_q" in name:
            param.fill_(1.0)
        else:
            param.normal_(0.0, 0.02, generator=gen)
    model.eval().requires_grad_(False)
    return LoadedModel(family, config, model, model_dir=None, dtype=dtype, device=device)
