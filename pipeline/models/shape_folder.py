"""A model folder without weights for a named shape: config.json,
preprocessor_config.json and the synthetic tokenizer with the family's chat
template, so the proxy and the stages load a random-weight shape exactly
like a checkpoint folder.

`python -m pipeline.models.shape_folder SHAPE [OUT_DIR]` writes one (default:
the cache folder, `shape_model_dir`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from pipeline.models.shape_configs import QWEN3_VL_SPECIAL_IDS, QWEN25_VL_SPECIAL_IDS, shape_config
from pipeline.models.shape_tokenizer import write_shape_tokenizer
from pipeline.models.tiny import preprocessor_config
from pipeline.models.tiny_tokenizer import QWEN2_VL_CHAT_TEMPLATE, QWEN3_VL_CHAT_TEMPLATE

# Bump when the folder's content changes, so cached copies are rebuilt.
SHAPE_FOLDER_VERSION = 1
# Qwen2.5-VL's released preprocessor bounds (the tiny model caps max_pixels lower).
MIN_PIXELS, MAX_PIXELS = 3136, 12845056
# preprocessor_config.json of the Qwen3-VL-Instruct checkpoints: 16-pixel
# patches, mean and std 0.5, and an area between 256x256 and 4096x4096.
QWEN3_VL_PREPROCESSOR = {
    "size": {"longest_edge": 16777216, "shortest_edge": 65536},
    "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
    "processor_class": "Qwen3VLProcessor", "image_processor_type": "Qwen2VLImageProcessorFast",
}
# Fields whose values the folder and the random weights must agree on
# (text_config holds the vocabulary and width where a family nests them).
_MATCHED_FIELDS = ("vocab_size", "hidden_size", "image_token_id", "video_token_id", "eos_token_id",
                   "vision_start_token_id", "vision_end_token_id", "vision_config", "text_config")


@dataclass(frozen=True)
class FamilyFiles:
    """What a family's checkpoint folder holds besides config.json."""

    special_ids: dict[str, int]
    chat_template: str
    preprocessor: dict


def family_files(config: dict) -> FamilyFiles:
    """The tokenizer, template and processor settings for a shape's model_type."""
    model_type = config.get("model_type")
    if model_type == "qwen2_5_vl":
        processor = {**preprocessor_config(), "min_pixels": MIN_PIXELS, "max_pixels": MAX_PIXELS}
        return FamilyFiles(QWEN25_VL_SPECIAL_IDS, QWEN2_VL_CHAT_TEMPLATE, processor)
    if model_type == "qwen3_vl":
        return FamilyFiles(QWEN3_VL_SPECIAL_IDS, QWEN3_VL_CHAT_TEMPLATE, dict(QWEN3_VL_PREPROCESSOR))
    raise ValueError(f"no synthetic checkpoint files for model_type {model_type!r}")


def _vocab_size(config: dict) -> int:
    return config.get("vocab_size") or config["text_config"]["vocab_size"]


def write_shape_folder(shape: str, out_dir: Path) -> Path:
    config = shape_config(shape)
    files = family_files(config)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_shape_tokenizer(out_dir, files.special_ids, _vocab_size(config), chat_template=files.chat_template)
    (out_dir / "preprocessor_config.json").write_text(json.dumps(files.preprocessor, indent=2) + "\n")
    # Last: its presence marks a complete folder.
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out_dir


def cache_root() -> Path:
    """$EPD_CACHE_DIR, else $XDG_CACHE_HOME/epd, else ~/.cache/epd (as the tiny model)."""
    return Path(os.environ.get("EPD_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "epd"))


def shape_model_dir(shape: str) -> Path:
    """The shape's folder in the cache, written on first use."""
    shape_config(shape)  # an unknown name fails before anything is written
    target = cache_root() / f"{shape}-v{SHAPE_FOLDER_VERSION}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Written beside the target and renamed, so stages starting at once never
    # see a half-written folder.
    staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        write_shape_folder(shape, staging)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def check_folder_matches(shape: str, model_dir: Path) -> None:
    """A stage serving random weights of `shape` with the tokenizer and
    processor of `model_dir`: their token ids and sizes must agree."""
    expected = shape_config(shape)
    path = Path(model_dir) / "config.json"
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--random-weights {shape}: cannot read {path}: {exc}") from None
    for field in _MATCHED_FIELDS:
        if found.get(field) != expected.get(field):
            raise ValueError(f"--random-weights {shape}: {path} has {field}={found.get(field)!r}, "
                             f"the shape has {expected.get(field)!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("shape")
    parser.add_argument("out_dir", type=Path, nargs="?")
    args = parser.parse_args(argv)
    try:
        path = write_shape_folder(args.shape, args.out_dir) if args.out_dir else shape_model_dir(args.shape)
    except ValueError as exc:
        parser.exit(2, f"shape_folder: error: {exc}\n")
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
