"""What a model stage (encoder, generator) serves: a checkpoint folder, or a
named shape's random weights beside that shape's weightless folder
(tokenizer, processor config).

`part`: "visual" (an encoder), "language" (an EPD generator: a random shape
leaves its vision tower unallocated; a checkpoint loads everything), or None
(an aggregated generator).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from pipeline.models.checkpoint import parse_dtype
from pipeline.models.loader import load_model
from pipeline.models.shape_configs import SHAPES
from pipeline.models.shape_folder import check_folder_matches, shape_model_dir
from pipeline.models.shapes import random_model
from pipeline.models.tiny import default_model_dir


def add_random_weights_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--random-weights", choices=tuple(SHAPES), metavar="SHAPE",
                        help=f"random weights of a named shape ({', '.join(SHAPES)}) made on the device; "
                        "--model defaults to the shape's weightless folder")


def stage_model_dir(model: Path | None, random_weights: str | None) -> Path:
    """--model, else the shape's folder with --random-weights, else the
    built-in tiny checkpoint. ValueError if the folder does not fit the shape."""
    if random_weights is None:
        return model or default_model_dir()
    folder = model or shape_model_dir(random_weights)
    check_folder_matches(random_weights, folder)
    return folder


def load_stage_model(model_dir: Path, random_weights: str | None, dtype: str, device: torch.device,
                     part: str | None) -> torch.nn.Module:
    if random_weights is not None:
        return random_model(random_weights, parse_dtype(dtype), device, part=part).model
    checkpoint_part = None if part == "language" else part
    return load_model(model_dir, dtype=dtype, device=str(device), part=checkpoint_part).model
