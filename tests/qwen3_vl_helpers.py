"""Tiny random Qwen3-VL checkpoints written by the reference implementation
(transformers' own save_pretrained), its image processor, and prompts of
text and image spans, for the Qwen3-VL oracle tests; and a complete,
serving-ready folder (tokenizer, chat template, processor config) with the
reference processor that reads it.

Imports transformers, so it lives with the tests, never on the serving path.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pipeline.models.tiny_tokenizer import QWEN3_VL_CHAT_TEMPLATE, write_tiny_tokenizer

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


# Token ids of the oracle checkpoints: no tokenizer, so any ids below VOCAB do.
ORACLE_TOKENS = dict(vocab_size=VOCAB, image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN,
                     vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)


def reference_config(shape: dict, tokens: dict | None = None, text_tokens: dict | None = None):
    """tokens: vocab_size and the four vision token ids (ORACLE_TOKENS by
    default); text_tokens: bos/eos/pad ids for the language model's config."""
    from transformers import Qwen3VLConfig

    tokens = dict(ORACLE_TOKENS if tokens is None else tokens)
    vocab_size = tokens.pop("vocab_size")
    text = dict(shape["text"], **(text_tokens or {}))
    section = text.pop("mrope_section")
    return Qwen3VLConfig(
        text_config=dict(
            text, vocab_size=vocab_size, max_position_embeddings=4096,
            tie_word_embeddings=shape["tie"],
            rope_parameters={"rope_type": "default", "mrope_section": section, "mrope_interleaved": True,
                             "rope_theta": 10000.0}),
        vision_config=dict(shape["vision"], out_hidden_size=shape["text"]["hidden_size"], patch_size=16,
                           spatial_merge_size=2, temporal_patch_size=2),
        tie_word_embeddings=shape["tie"], **tokens)


def write_checkpoint(out_dir: Path, shape: dict, seed: int = 1234, config=None) -> Path:
    """Every parameter drawn afresh (norm weights and biases too: the
    reference's init leaves those at 1 and 0, which would hide a swapped
    or skipped norm), then saved by the reference. `config`: a
    reference_config other than the shape's oracle one."""
    from transformers import Qwen3VLForConditionalGeneration

    model = Qwen3VLForConditionalGeneration(reference_config(shape) if config is None else config)
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


# ---------------------------------------------------------------- a serving-ready folder

# The image processor settings of the published Qwen3-VL-Instruct
# checkpoints' preprocessor_config.json (transformers has no Qwen3-VL image
# processor class of its own: the checkpoints configure Qwen2-VL's).
PUBLISHED_IMAGE_PROCESSOR = dict(
    patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3,
    size={"shortest_edge": 65536, "longest_edge": 16777216})


def published_image_processor(**overrides):
    """The reference's PIL image processor configured as a Qwen3-VL checkpoint configures it."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(**{**PUBLISHED_IMAGE_PROCESSOR, **overrides})


def write_serving_checkpoint(out_dir: Path, shape: str = "taps01", seed: int = 1234) -> Path:
    """A complete Qwen3-VL folder our stack and the reference both load:
    weights and config.json by the reference's save_pretrained (float32),
    the tiny tokenizer's files with its real special-token ids in the
    config, a Qwen3-VL-style chat template, generation_config.json, and
    preprocessor_config.json saved by the reference image processor."""
    out_dir = Path(out_dir)
    special = write_tiny_tokenizer(out_dir)
    generation = (out_dir / "generation_config.json").read_text()
    tokens = dict(vocab_size=special["vocab_size"], image_token_id=special["<|image_pad|>"],
                  video_token_id=special["<|video_pad|>"], vision_start_token_id=special["<|vision_start|>"],
                  vision_end_token_id=special["<|vision_end|>"])
    text_tokens = dict(bos_token_id=special["<|endoftext|>"], eos_token_id=special["<|im_end|>"],
                       pad_token_id=special["<|endoftext|>"])
    write_checkpoint(out_dir, SHAPES[shape], seed, reference_config(SHAPES[shape], tokens, text_tokens))
    # The model's save_pretrained wrote a generation_config.json of its own;
    # the checkpoint's is the tokenizer's (both end-of-turn ids).
    (out_dir / "generation_config.json").write_text(generation)
    (out_dir / "chat_template.jinja").write_text(QWEN3_VL_CHAT_TEMPLATE, encoding="utf-8")
    published_image_processor().save_pretrained(out_dir)
    return out_dir


def reference_processor(model_dir: Path):
    """transformers' Qwen3VLProcessor over the folder's tokenizer, template
    and image processor (the PIL one).

    AutoProcessor cannot build it here: the processor needs a video
    processor, the only Qwen3-VL one (Qwen3VLVideoProcessor) needs
    torchvision, which is not installed, and ProcessorMixin's type check of
    that argument fails too (BaseVideoProcessor is a torchvision-gated
    placeholder). So the real class is built directly with no video
    processor, skipping only that one check; images and text go through the
    reference's own code.
    """
    from transformers import AutoImageProcessor, AutoTokenizer, Qwen3VLProcessor

    class ImageOnlyQwen3VLProcessor(Qwen3VLProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    image_processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
    return ImageOnlyQwen3VLProcessor(image_processor=image_processor, tokenizer=tokenizer,
                                     video_processor=None, chat_template=tokenizer.chat_template)
