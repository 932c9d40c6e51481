"""The stages' flags for how vision forwards run: on the fused Triton kernels
(the default on CUDA) or the plain PyTorch ops; eagerly, or replayed as CUDA
graphs (pipeline/models/vision_graphs.py), with the graphs of known image
sizes captured at start-up so serving never pauses on a first capture."""

from __future__ import annotations

import argparse

import torch

from pipeline.arg_parser import image_sizes

from pipeline.models.vision_graphs import vision_forward
from pipeline.processing.image import ImageProcessorConfig, image_grid_thw



def add_vision_graph_flags(parser: argparse.ArgumentParser, scope: str = "") -> None:
    parser.add_argument("--vision-graphs", type=int, default=0, metavar="N",
                        help=f"{scope}CUDA: replay vision forwards as CUDA graphs, keeping up to N (0: eager)")
    parser.add_argument("--vision-warmup", type=image_sizes, default=[], metavar="WxH[,WxH...]",
                        help="image sizes (pixels) whose vision graphs are captured at start-up")
    parser.add_argument("--eager-vision", action="store_true",
                        help=f"{scope}CUDA: run the vision tower on plain PyTorch ops, not the fused Triton "
                             "kernels (the default wherever they run)")


def check_vision_graph_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.vision_graphs < 0:
        parser.error("--vision-graphs must be 0 or more")
    if args.vision_warmup and not args.vision_graphs:
        parser.error("--vision-warmup needs --vision-graphs")


def stage_vision_forward(tower: torch.nn.Module, device: torch.device, args: argparse.Namespace,
                         image_config: ImageProcessorConfig):
    """The callable a stage runs vision forwards with, from its flags."""
    if not args.eager_vision:
        fuse_vision_tower(tower, device)
    grids = [image_grid_thw(h, w, image_config) for w, h in args.vision_warmup]
    return vision_forward(tower, device, args.vision_graphs, list(dict.fromkeys(grids)))


def fuse_vision_tower(tower: torch.nn.Module, device: torch.device) -> bool:
    """Put the tower on the fused Triton kernels where they run (CUDA, triton
    installed); on an H200 that took a Qwen2.5-VL-3B forward of 16 images of
    640x640 from 16.3 to 6.1 ms per image (docs/benchmarks.md). Returns
    whether it did."""
    from pipeline import kernels
    if device.type != "cuda" or not kernels.available(device) or not hasattr(tower, "fuse"):
        return False
    from pipeline.kernels.ops import TritonLayerOps   # imports triton: only where it runs
    tower.fuse(TritonLayerOps())
    return True
