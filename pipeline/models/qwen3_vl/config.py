"""Qwen3-VL (dense) config, read from config.json.

transformers 5 writes the language model's fields under `text_config` with
`rope_parameters`; hub checkpoints keep `rope_scaling` and `rope_theta`
there instead, and `tie_word_embeddings` at the top level. Both map onto the
same frozen config. Defaults are the reference's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pipeline.models.config_fields import check_divides, eos_token_ids, int_field, media_token_fields
from pipeline.models.spec import ModelSpec, spec_from_config

# The vision tower's activations the reference offers that we implement.
VISION_ACTS = ("gelu_pytorch_tanh", "gelu")


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    out_hidden_size: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    in_channels: int
    hidden_act: str
    rope_theta: float
    num_position_embeddings: int
    deepstack_visual_indexes: tuple[int, ...]

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def position_grid_side(self) -> int:
        """Side of the square learned position table."""
        return math.isqrt(self.num_position_embeddings)


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, int, int]
    max_position_embeddings: int
    hidden_act: str
    attention_bias: bool
    tie_word_embeddings: bool


@dataclass(frozen=True)
class Qwen3VLConfig:
    vision: VisionConfig
    text: TextConfig
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    eos_token_ids: tuple[int, ...]

    @property
    def max_context(self) -> int:
        return self.text.max_position_embeddings

    @property
    def deepstack_levels(self) -> int:
        return len(self.vision.deepstack_visual_indexes)


def parse_config(raw: dict[str, Any]) -> Qwen3VLConfig:
    text_raw = dict(raw.get("text_config") or {})
    for key, value in raw.items():   # fields a config keeps at the top level
        if key not in ("text_config", "vision_config"):
            text_raw.setdefault(key, value)
    vision = _parse_vision(raw.get("vision_config") or {})
    text = _parse_text(text_raw, raw)
    if vision.out_hidden_size != text.hidden_size:
        raise ValueError(
            f"vision_config.out_hidden_size ({vision.out_hidden_size}) must equal the language "
            f"model hidden_size ({text.hidden_size}) for Qwen3-VL")
    if len(vision.deepstack_visual_indexes) > text.num_hidden_layers:
        raise ValueError(
            f"vision_config.deepstack_visual_indexes has {len(vision.deepstack_visual_indexes)} levels, "
            f"more than the language model's num_hidden_layers ({text.num_hidden_layers}) can take")
    return Qwen3VLConfig(
        vision=vision,
        text=text,
        **media_token_fields(raw),
        eos_token_ids=eos_token_ids(text_raw),
    )


def _parse_vision(v: dict[str, Any]) -> VisionConfig:
    rope = v.get("rope_parameters") or {}
    indexes = v.get("deepstack_visual_indexes", (8, 16, 24))
    if not isinstance(indexes, (list, tuple)) or not all(type(i) is int for i in indexes):
        raise ValueError(f"vision_config.deepstack_visual_indexes must be a list of integers, got {indexes!r}")
    cfg = VisionConfig(
        depth=int_field(v, "depth", 27),
        hidden_size=int_field(v, "hidden_size", 1152),
        intermediate_size=int_field(v, "intermediate_size", 4304),
        num_heads=int_field(v, "num_heads", 16),
        out_hidden_size=int_field(v, "out_hidden_size", 3584),
        patch_size=int_field(v, "patch_size", 16),
        temporal_patch_size=int_field(v, "temporal_patch_size", 2),
        spatial_merge_size=int_field(v, "spatial_merge_size", 2),
        in_channels=int_field(v, "in_channels", 3),
        hidden_act=str(v.get("hidden_act", "gelu_pytorch_tanh")),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        num_position_embeddings=int_field(v, "num_position_embeddings", 2304),
        deepstack_visual_indexes=tuple(indexes),
    )
    check_divides("vision_config.hidden_size", cfg.hidden_size, "num_heads", cfg.num_heads)
    if cfg.head_dim % 4:
        raise ValueError(f"vision_config head_dim ({cfg.head_dim}) must be a multiple of 4 for 2-D rotary")
    if cfg.spatial_merge_size < 1:
        raise ValueError("vision_config.spatial_merge_size must be at least 1")
    side = cfg.position_grid_side
    if side < 1 or side * side != cfg.num_position_embeddings:
        raise ValueError(
            f"vision_config.num_position_embeddings ({cfg.num_position_embeddings}) must be a "
            "positive square (the learned positions are a square grid)")
    taps = cfg.deepstack_visual_indexes
    if any(not 0 <= i < cfg.depth for i in taps) or list(taps) != sorted(set(taps)):
        raise ValueError(
            f"vision_config.deepstack_visual_indexes {list(taps)} must be strictly increasing "
            f"block indexes in [0, depth={cfg.depth})")
    if cfg.hidden_act not in VISION_ACTS:
        raise ValueError(f"vision_config.hidden_act {cfg.hidden_act!r} is not supported; expected one of {VISION_ACTS}")
    if (rope.get("rope_type") or "axial") != "axial":
        raise ValueError(f"vision_config.rope_parameters.rope_type {rope.get('rope_type')!r}: only 'axial' exists")
    return cfg


def _parse_text(t: dict[str, Any], top: dict[str, Any]) -> TextConfig:
    rope = t.get("rope_parameters") or t.get("rope_scaling") or {}
    heads = int_field(t, "num_attention_heads", 32)
    kv_heads = t.get("num_key_value_heads")
    section = tuple(int(x) for x in rope.get("mrope_section", (24, 20, 20)))
    cfg = TextConfig(
        vocab_size=int_field(t, "vocab_size", 151936),
        hidden_size=int_field(t, "hidden_size", 4096),
        intermediate_size=int_field(t, "intermediate_size", 22016),
        num_hidden_layers=int_field(t, "num_hidden_layers", 32),
        num_attention_heads=heads,
        num_key_value_heads=heads if kv_heads is None else int_field(t, "num_key_value_heads", heads),
        head_dim=int_field(t, "head_dim", 128),
        rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", t.get("rope_theta", 500000.0))),
        mrope_section=section,  # type: ignore[arg-type]
        max_position_embeddings=int_field(t, "max_position_embeddings", 128000),
        hidden_act=str(t.get("hidden_act", "silu")),
        attention_bias=bool(t.get("attention_bias", False)),
        tie_word_embeddings=bool(top.get("tie_word_embeddings", t.get("tie_word_embeddings", False))),
    )
    check_divides("num_attention_heads", heads, "num_key_value_heads", cfg.num_key_value_heads)
    if cfg.head_dim == 0 or cfg.head_dim % 2:
        raise ValueError(f"text_config.head_dim ({cfg.head_dim}) must be a positive even number")
    _check_mrope_section(section, cfg.head_dim)
    if rope.get("mrope_interleaved") is False:
        raise ValueError("rope_parameters.mrope_interleaved=false is not supported: Qwen3-VL interleaves M-RoPE")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "mrope"):
        raise ValueError(f"rope type {kind!r} is not supported; expected 'default' or 'mrope'")
    if cfg.hidden_act != "silu":
        raise ValueError(f"text_config.hidden_act {cfg.hidden_act!r} is not supported; Qwen3-VL uses 'silu'")
    return cfg


def _check_mrope_section(section: tuple[int, ...], head_dim: int) -> None:
    """Three parts summing to head_dim/2. The interleaved layout may give an
    axis fewer bands than its part (every third band, up to head_dim/2):
    the reference allows that, and rotary.interleaved_band_axes follows it."""
    if len(section) != 3 or sum(section) * 2 != head_dim:
        raise ValueError(
            f"mrope_section {list(section)} must have 3 parts summing to head_dim/2 ({head_dim // 2})")


def model_spec(cfg: Qwen3VLConfig) -> ModelSpec:
    """What the serving code may know of this model (pipeline/models/spec.py)."""
    # Its processor puts a timestamp before each temporal patch of a video.
    return spec_from_config("qwen3_vl", cfg, side_levels=cfg.deepstack_levels, frame_spans=True)
