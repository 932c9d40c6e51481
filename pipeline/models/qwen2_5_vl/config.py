"""Qwen2.5-VL config, read from both config.json layouts.

Hub checkpoints keep the language model's fields at the top level with
`rope_scaling: {"type": "mrope", ...}`; transformers 5 writes them under
`text_config` with `rope_parameters`. Both map onto the same frozen config.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pipeline.models.config_fields import check_divides, eos_token_ids, int_field, media_token_fields
from pipeline.models.spec import ModelSpec, spec_from_config


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
    window_size: int
    fullatt_block_indexes: tuple[int, ...]
    in_channels: int
    hidden_act: str
    rope_theta: float
    tokens_per_second: float = 4.0  # time-axis positions per second of video (the reference's default)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rms_norm_eps: float
    rope_theta: float
    mrope_section: tuple[int, int, int]
    max_position_embeddings: int
    hidden_act: str
    tie_word_embeddings: bool

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass(frozen=True)
class Qwen25VLConfig:
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


def parse_config(raw: dict[str, Any]) -> Qwen25VLConfig:
    text_raw = dict(raw.get("text_config") or {})
    # Hub layout: language-model fields live at the top level.
    for key, value in raw.items():
        if key not in ("text_config", "vision_config"):
            text_raw.setdefault(key, value)
    vision = _parse_vision(raw.get("vision_config") or {})
    text = _parse_text(text_raw, raw)
    if vision.out_hidden_size != text.hidden_size:
        raise ValueError(
            f"vision_config.out_hidden_size ({vision.out_hidden_size}) must equal the language "
            f"model hidden_size ({text.hidden_size}) for Qwen2.5-VL")
    return Qwen25VLConfig(
        vision=vision,
        text=text,
        **media_token_fields(raw),
        eos_token_ids=eos_token_ids(text_raw),
    )


def _parse_vision(v: dict[str, Any]) -> VisionConfig:
    rope = v.get("rope_parameters") or {}
    cfg = VisionConfig(
        depth=int_field(v, "depth", 32),
        hidden_size=int_field(v, "hidden_size", 3584),
        intermediate_size=int_field(v, "intermediate_size", 3420),
        num_heads=int_field(v, "num_heads", 16),
        out_hidden_size=int_field(v, "out_hidden_size", 3584),
        patch_size=int_field(v, "patch_size", v.get("spatial_patch_size", 14)),
        temporal_patch_size=int_field(v, "temporal_patch_size", 2),
        spatial_merge_size=int_field(v, "spatial_merge_size", 2),
        window_size=int_field(v, "window_size", 112),
        fullatt_block_indexes=tuple(int(i) for i in v.get("fullatt_block_indexes", (7, 15, 23, 31))),
        in_channels=int_field(v, "in_channels", v.get("in_chans", 3)),
        hidden_act=str(v.get("hidden_act", "silu")),
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        tokens_per_second=float(v.get("tokens_per_second", 4)),
    )
    check_divides("vision_config.hidden_size", cfg.hidden_size, "num_heads", cfg.num_heads)
    if cfg.head_dim % 4:
        raise ValueError(f"vision_config head_dim ({cfg.head_dim}) must be a multiple of 4 for 2-D rotary")
    unit = cfg.spatial_merge_size * cfg.patch_size
    if cfg.window_size % unit or cfg.window_size < unit:
        raise ValueError(
            f"vision_config.window_size ({cfg.window_size}) must be a positive multiple of "
            f"patch_size*spatial_merge_size ({unit})")
    bad = [i for i in cfg.fullatt_block_indexes if not 0 <= i < cfg.depth]
    if bad:
        raise ValueError(f"vision_config.fullatt_block_indexes {bad} outside [0, depth={cfg.depth})")
    _check_act("vision_config.hidden_act", cfg.hidden_act)
    return cfg


def _parse_text(t: dict[str, Any], top: dict[str, Any]) -> TextConfig:
    rope = t.get("rope_parameters") or t.get("rope_scaling") or {}
    heads = int_field(t, "num_attention_heads", 64)
    section = tuple(int(x) for x in rope.get("mrope_section", (16, 24, 24)))
    tie = bool(top.get("tie_word_embeddings", t.get("tie_word_embeddings", False)))
    cfg = TextConfig(
        vocab_size=int_field(t, "vocab_size", 152064),
        hidden_size=int_field(t, "hidden_size", 8192),
        intermediate_size=int_field(t, "intermediate_size", 29568),
        num_hidden_layers=int_field(t, "num_hidden_layers", 80),
        num_attention_heads=heads,
        num_key_value_heads=int_field(t, "num_key_value_heads", heads),
        rms_norm_eps=float(t.get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope.get("rope_theta", t.get("rope_theta", 1000000.0))),
        mrope_section=section,  # type: ignore[arg-type]
        max_position_embeddings=int_field(t, "max_position_embeddings", 32768),
        hidden_act=str(t.get("hidden_act", "silu")),
        tie_word_embeddings=tie,
    )
    check_divides("hidden_size", cfg.hidden_size, "num_attention_heads", heads)
    check_divides("num_attention_heads", heads, "num_key_value_heads", cfg.num_key_value_heads)
    if len(section) != 3 or sum(section) * 2 != cfg.head_dim:
        raise ValueError(
            f"mrope_section {list(section)} must have 3 parts summing to head_dim/2 ({cfg.head_dim // 2})")
    if t.get("use_sliding_window"):
        raise ValueError("use_sliding_window=true is not supported (no released Qwen2.5-VL uses it)")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "mrope"):
        raise ValueError(f"rope type {kind!r} is not supported; expected 'default' or 'mrope'")
    _check_act("hidden_act", cfg.hidden_act)
    return cfg


def _check_act(name: str, act: str) -> None:
    if act != "silu":
        raise ValueError(f"{name} {act!r} is not supported; Qwen2.5-VL uses 'silu'")


def model_spec(cfg: Qwen25VLConfig) -> ModelSpec:
    """What the serving code may know of this model (pipeline/models/spec.py)."""
    return spec_from_config("qwen2_5_vl", cfg)
