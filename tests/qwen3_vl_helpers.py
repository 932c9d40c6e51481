"""Tiny random Qwen3-VL checkpoints written by the reference implementation
(transformers' own save_pretrained), its image processor, and prompts of
text and image spans, for the Qwen3-VL oracle tests.

Imports transformers, so it lives with the tests, never on the serving path.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 512
IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 500, 501, 502, 503
INIT_STD = 0.1      # large enough that greedy argmax has no near-ties
VISION_STD = 0.08   # moderate, so the tower's outputs stay in a trained tower's range

# Two shapes that differ where the code has choices: DeepStack taps and how
# many there are, GQA ratio, attention bias, tying, an mrope_section that the
# interleaved layout fits exactly ([4, 4, 4] over 12 bands) or truncates
# ([2, 3, 3] over 8 bands: w gets 2), position tables of 8x8 and 6x6.
SHAPES = {
    "taps01": dict(
        text=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, attention_bias=False, mrope_section=[2, 3, 3]),
        vision=dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2,
                    num_position_embeddings=64, deepstack_visual_indexes=[0, 1]),
        tie=False),
    "taps123": dict(
        text=dict(hidden_size=96, intermediate_size=160, num_hidden_layers=4, num_attention_heads=3,
                  num_key_value_heads=1, head_dim=24, attention_bias=True, mrope_section=[4, 4, 4]),
        vision=dict(depth=4, hidden_size=48, intermediate_size=80, num_heads=3,
                    num_position_embeddings=36, deepstack_visual_indexes=[1, 2, 3]),
        tie=True),
}


def reference_config(shape: dict):
    from transformers import Qwen3VLConfig

    text = dict(shape["text"])
    section = text.pop("mrope_section")
    return Qwen3VLConfig(
        text_config=dict(
            text, vocab_size=VOCAB, max_position_embeddings=4096, tie_word_embeddings=shape["tie"],
            rope_parameters={"rope_type": "default", "mrope_section": section, "mrope_interleaved": True,
                             "rope_theta": 10000.0}),
        vision_config=dict(shape["vision"], out_hidden_size=shape["text"]["hidden_size"], patch_size=16,
                           spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN,
        vision_start_token_id=VISION_START, vision_end_token_id=VISION_END,
        tie_word_embeddings=shape["tie"])


def write_checkpoint(out_dir: Path, shape: dict, seed: int = 1234) -> Path:
    """Every parameter drawn afresh (norm weights and biases too: the
    reference's init leaves those at 1 and 0, which would hide a swapped
    or skipped norm), then saved by the reference."""
    from transformers import Qwen3VLForConditionalGeneration

    model = Qwen3VLForConditionalGeneration(reference_config(shape))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            std = VISION_STD if name.startswith("model.visual.") else INIT_STD
            noise = std * torch.randn(param.shape, generator=gen)
            param.copy_(1.0 + noise if _is_norm_weight(name) else noise)
    model.save_pretrained(out_dir)
    return Path(out_dir)


def _is_norm_weight(name: str) -> bool:
    return name.endswith(".weight") and "norm" in name.rsplit(".", 2)[-2]


def image_processor():
    """The processor as Qwen3VLProcessor configures it (16-pixel patches,
    mean and std 0.5), the PIL one (use_fast=False); small minimum size so
    a 32x32 image stays one merged token."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
        size={"shortest_edge": 32 * 32, "longest_edge": 512 * 512})


def pixels_for(images) -> tuple[torch.Tensor, torch.Tensor]:
    out = image_processor()(images=images, return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def prompt_ids(grids: list[tuple[int, int, int]], seed: int = 0) -> tuple[list[int], list[tuple[int, int]]]:
    """Text, then for each image <vision_start> image tokens <vision_end>
    and more text: the token ids and each image's (start, length) span."""
    gen = torch.Generator().manual_seed(seed)

    def text(n: int) -> list[int]:
        return torch.randint(0, IMAGE_TOKEN, (n,), generator=gen).tolist()

    ids, spans = text(5), []
    for i, (t, h, w) in enumerate(grids):
        ids.append(VISION_START)
        spans.append((len(ids), t * h * w // 4))
        ids += [IMAGE_TOKEN] * spans[-1][1] + [VISION_END] + text(3 + i)
    return ids + text(4), spans
