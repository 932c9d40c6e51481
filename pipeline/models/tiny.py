"""A tiny deterministic random Qwen2.5-VL checkpoint, in the hub layout.

`python -m pipeline.models.tiny OUT_DIR` writes config.json, model.safetensors,
the tokenizer, chat template and preprocessor config (well under 1 MB). It is
the default model when none is given and the fixture of the tests. Weights use
a larger init scale than training would, so greedy decoding is not decided by
near-ties between logits.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from pipeline.models.registry import family_for
from pipeline.models.tiny_tokenizer import write_tiny_tokenizer

# Bump when the checkpoint's content changes, so cached copies are rebuilt.
TINY_VERSION = 1
INIT_STD = 0.1
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]


def tiny_config(special: dict[str, int]) -> dict:
    """config.json as the hub writes it for Qwen2.5-VL: language-model fields
    at the top level, rope_scaling of type mrope, vision_config nested."""
    return {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"],
        "model_type": "qwen2_5_vl",
        "torch_dtype": "float32",
        "vocab_size": special["vocab_size"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "max_position_embeddings": 8192,
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "bos_token_id": special["<|endoftext|>"],
        "eos_token_id": special["<|im_end|>"],
        "vision_start_token_id": special["<|vision_start|>"],
        "vision_end_token_id": special["<|vision_end|>"],
        "vision_token_id": special["<|vision_pad|>"],
        "image_token_id": special["<|image_pad|>"],
        "video_token_id": special["<|video_pad|>"],
        "vision_config": {
            "depth": 4,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": 64,
            "hidden_act": "silu",
            "in_chans": 3,
            "patch_size": 14,
            "spatial_patch_size": 14,
            "temporal_patch_size": 2,
            "spatial_merge_size": 2,
            "window_size": 56,
            "fullatt_block_indexes": [1, 3],
            "tokens_per_second": 2,
        },
    }


def preprocessor_config() -> dict:
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "processor_class": "Qwen2_5_VLProcessor",
        "do_resize": True,
        "do_rescale": True,
        "do_normalize": True,
        "do_convert_rgb": True,
        "resample": 3,
        "rescale_factor": 1 / 255,
        "image_mean": CLIP_MEAN,
        "image_std": CLIP_STD,
        "min_pixels": 56 * 56,
        "max_pixels": 1280 * 28 * 28,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
    }


def random_weights(raw_config: dict, seed: int) -> dict[str, torch.Tensor]:
    """Deterministic weights for every parameter of the model the config
    describes, named as in the checkpoint."""
    family = family_for(raw_config)
    config = family.parse_config(raw_config)
    with torch.device("meta"):
        model = family.build(config, torch.float32)
    gen = torch.Generator().manual_seed(seed)
    weights = {}
    for name, param in sorted(model.named_parameters()):
        if _is_norm_weight(name):
            value = 1.0 + INIT_STD * torch.randn(param.shape, generator=gen)
        else:
            value = INIT_STD * torch.randn(param.shape, generator=gen)
        weights[name] = value.contiguous()
    return weights


def _is_norm_weight(name: str) -> bool:
    module = name.rsplit(".", 2)[-2]
    return "norm" in module or module == "ln_q"


def write_tiny_checkpoint(out_dir: Path, seed: int = 0) -> Path:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    special = write_tiny_tokenizer(out_dir)
    config = tiny_config(special)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "preprocessor_config.json").write_text(json.dumps(preprocessor_config(), indent=2) + "\n")
    save_file(random_weights(config, seed), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def default_model_dir() -> Path:
    """The built-in tiny checkpoint, written on first use into the cache
    folder ($EPD_CACHE_DIR, else $XDG_CACHE_HOME/epd, else ~/.cache/epd)."""
    base = os.environ.get("EPD_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "epd")
    target = Path(base) / f"tiny-qwen2.5-vl-v{TINY_VERSION}"
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Written beside the target and renamed, so a concurrent first use (many
    # stages starting at once) never sees a half-written folder.
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        write_tiny_checkpoint(staging)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = write_tiny_checkpoint(args.out_dir, args.seed)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
