"""Named model shapes: the config.json of a published checkpoint (hub
layout), without weights. Torch-free, so the launcher can check a shape name
without importing torch.

Every shape keeps its family's real vocabulary size and special-token ids
(Qwen3-VL's are Qwen2.5-VL's plus four), so the synthetic tokenizer of
shape_folder.py serves all of them. The `-tiny` shapes are a family's
smallest layout shrunk to CPU-test size (the embedding table keeps its
151936 rows).
"""

from __future__ import annotations

import copy

# Qwen2.5-VL's special tokens at their real ids (tokenizer.json's added_tokens).
QWEN25_VL_SPECIAL_IDS = {
    "<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
    "<|object_ref_start|>": 151646, "<|object_ref_end|>": 151647, "<|box_start|>": 151648,
    "<|box_end|>": 151649, "<|quad_start|>": 151650, "<|quad_end|>": 151651,
    "<|vision_start|>": 151652, "<|vision_end|>": 151653, "<|vision_pad|>": 151654,
    "<|image_pad|>": 151655, "<|video_pad|>": 151656, "<tool_call>": 151657, "</tool_call>": 151658,
    "<|fim_prefix|>": 151659, "<|fim_middle|>": 151660, "<|fim_suffix|>": 151661, "<|fim_pad|>": 151662,
    "<|repo_name|>": 151663, "<|file_sep|>": 151664,
}
QWEN25_VL_VOCAB_SIZE = 151936  # the embedding table; ids past the last special are padding rows

_QWEN25_VL_TOKEN_FIELDS = {
    "vocab_size": QWEN25_VL_VOCAB_SIZE, "bos_token_id": 151643, "eos_token_id": 151645,
    "image_token_id": 151655, "video_token_id": 151656, "vision_token_id": 151654,
    "vision_start_token_id": 151652, "vision_end_token_id": 151653,
}

_QWEN25_VL_3B = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
    "torch_dtype": "bfloat16", **_QWEN25_VL_TOKEN_FIELDS,
    "hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 36,
    "num_attention_heads": 16, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]}, "max_position_embeddings": 128000,
    "tie_word_embeddings": True, "hidden_act": "silu",
    "vision_config": {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
                      "out_hidden_size": 2048, "patch_size": 14, "spatial_merge_size": 2,
                      "temporal_patch_size": 2, "window_size": 112, "fullatt_block_indexes": [7, 15, 23, 31],
                      "hidden_act": "silu", "in_chans": 3},
}

_QWEN25_VL_TINY = {
    **_QWEN25_VL_3B, "torch_dtype": "float32",
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32768,
    "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
    "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                      "out_hidden_size": 64, "patch_size": 14, "spatial_merge_size": 2,
                      "temporal_patch_size": 2, "window_size": 112, "fullatt_block_indexes": [1],
                      "hidden_act": "silu", "in_chans": 3},
}

# Qwen3-VL's tokenizer: Qwen2.5-VL's specials at the same ids, then the four
# Qwen3 added (tool responses and thinking), still below the 151936 rows.
QWEN3_VL_SPECIAL_IDS = {
    **QWEN25_VL_SPECIAL_IDS,
    "<tool_response>": 151665, "</tool_response>": 151666, "<think>": 151667, "</think>": 151668,
}


def _qwen3_vl(text: dict, vision: dict, tie: bool) -> dict:
    """config.json as the Qwen3-VL-Instruct checkpoints on the hub have it:
    language-model fields under text_config with rope_scaling and rope_theta
    there, the vision tower under vision_config, token ids at the top."""
    return {
        "architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl",
        "image_token_id": 151655, "video_token_id": 151656,
        "vision_start_token_id": 151652, "vision_end_token_id": 151653, "tie_word_embeddings": tie,
        "text_config": {
            "model_type": "qwen3_vl_text", "dtype": "bfloat16", "vocab_size": QWEN25_VL_VOCAB_SIZE,
            "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
            "attention_bias": False, "rms_norm_eps": 1e-6, "max_position_embeddings": 262144,
            "rope_theta": 5000000, "tie_word_embeddings": tie,
            "rope_scaling": {"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True},
            **text},
        "vision_config": {
            "model_type": "qwen3_vl", "hidden_act": "gelu_pytorch_tanh", "in_channels": 3, "patch_size": 16,
            "temporal_patch_size": 2, "spatial_merge_size": 2, "num_position_embeddings": 2304,
            "out_hidden_size": text["hidden_size"], **vision},
    }


# The 2B and 4B share the 24-block tower (1024 wide, taps after blocks 5, 11,
# 17); the 8B has the 27-block SigLIP-2 tower (1152 wide, taps 8, 16, 24).
_QWEN3_VL_SMALL_TOWER = {"depth": 24, "hidden_size": 1024, "intermediate_size": 4096, "num_heads": 16,
                         "deepstack_visual_indexes": [5, 11, 17]}
_QWEN3_VL_2B = _qwen3_vl(
    {"hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28, "num_attention_heads": 16,
     "num_key_value_heads": 8}, _QWEN3_VL_SMALL_TOWER, tie=True)
_QWEN3_VL_4B = _qwen3_vl(
    {"hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36, "num_attention_heads": 32,
     "num_key_value_heads": 8}, _QWEN3_VL_SMALL_TOWER, tie=True)
_QWEN3_VL_8B = _qwen3_vl(
    {"hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
     "num_key_value_heads": 8},
    {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16,
     "deepstack_visual_indexes": [8, 16, 24]}, tie=False)
# Two text layers take the two DeepStack levels; head_dim 16 splits into the
# interleaved [2, 3, 3] bands; an 8x8 learned position table.
_QWEN3_VL_TINY = _qwen3_vl(
    {"dtype": "float32", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
     "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 32768,
     "rope_scaling": {"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True}},
    {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "num_position_embeddings": 64,
     "deepstack_visual_indexes": [0, 1]}, tie=True)

SHAPES = {
    "qwen2.5-vl-3b": _QWEN25_VL_3B, "qwen2.5-vl-tiny": _QWEN25_VL_TINY,
    "qwen3-vl-2b": _QWEN3_VL_2B, "qwen3-vl-4b": _QWEN3_VL_4B, "qwen3-vl-8b": _QWEN3_VL_8B,
    "qwen3-vl-tiny": _QWEN3_VL_TINY,
}


def shape_config(shape: str) -> dict:
    """A copy of the shape's config.json; ValueError names the known shapes."""
    if shape not in SHAPES:
        raise ValueError(f"unknown model shape {shape!r}; known: {', '.join(SHAPES)}")
    return copy.deepcopy(SHAPES[shape])
