#!/usr/bin/env python3
"""The vision tower on a GPU (run on the GPU box, not in CI):

1. equality: our tower of a named shape (--shape; default the Qwen2.5-VL-3B
   one; random bf16 weights made on the GPU) against transformers' own
   vision tower holding the same weights (every DeepStack level too), on
   batches of 640x640 images, on plain PyTorch ops and on the fused Triton
   kernels (VisionTower.fuse, the stages' default on CUDA); our captured
   forward (VisionGraphs, fused) against our eager fused one;
2. speed, side by side in one run, per batch size: transformers' forward,
   ours on plain ops, ours fused, ours fused and replayed as a CUDA graph;
   milliseconds per image and the ratios.

    python3 scripts/gpu_vision_check.py [--shape qwen3-vl-4b] [--batches 1,4,8,16] [--json out.json]

For a tower with full attention in every block, each batch also reports the
forward's FLOPs per image and the share of the box's bf16 matmul peak
(769 TFLOP/s measured on the H200) that our fastest forward reached.

Each section that fails is recorded with its traceback and the run goes on.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

from pipeline.models.shape_configs import shape_config  # noqa: E402
from pipeline.models.vision_flags import fuse_vision_tower  # noqa: E402
from pipeline.models.shape_folder import shape_model_dir  # noqa: E402
from pipeline.models.shapes import random_model  # noqa: E402
from pipeline.models.vision_graphs import VisionGraphs  # noqa: E402
from pipeline.processing.image import ImageProcessorConfig, image_grid_thw, preprocess_images  # noqa: E402


def images(n: int, size: int = 640, height: int | None = None) -> list[Image.Image]:
    rng = np.random.default_rng(n)
    shape = (height or size, size, 3)
    return [Image.fromarray(rng.integers(0, 255, shape, dtype=np.uint8)) for _ in range(n)]


def mixed_sizes(fused, graphs, config, device: torch.device, report: dict) -> None:
    """A batch of three image sizes, only one of them captured at warm-up:
    the graphs replay that size and run the others in one packed eager
    forward; equal to the fused eager forward; timed on a first call
    (nothing captured for the new sizes) and a third (captured)."""
    batch = images(4) + images(3, 480, 640) + images(2, 512)
    pixels, grid = preprocess_images(batch, config)
    pixels = pixels.to(device)
    grids = [tuple(g) for g in grid.tolist()]
    row = report.setdefault("mixed_sizes", {"images": len(batch)})
    with torch.inference_mode():
        want = torch.cat(fused(pixels, grids))
        row["eager_ms"] = median_ms(lambda: fused(pixels, grids), 3)
        for call in ("first", "second", "third"):
            started = time.perf_counter()
            got = torch.cat(graphs(pixels, grids))
            _sync()
            row[f"{call}_call_ms"] = (time.perf_counter() - started) * 1000
            row[f"{call}_vs_eager"] = compare(got, want)
        row["captured_ms"] = median_ms(lambda: graphs(pixels, grids), 5)
    print("mixed sizes:", json.dumps(row), flush=True)


def hf_tower(shape: str, ours: torch.nn.Module, device: torch.device):
    vision_config = shape_config(shape)["vision_config"]
    if shape.startswith("qwen3-vl"):
        from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig as Config
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel as Tower
    else:
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig as Config
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel as Tower)
    config = Config(**vision_config)
    config._attn_implementation = "sdpa"
    hf = Tower._from_config(config, dtype=torch.bfloat16).to(device)
    missing, unexpected = hf.load_state_dict(ours.state_dict(), strict=False)
    if unexpected or [m for m in missing if "inv_freq" not in m]:
        raise RuntimeError(f"weights do not map: missing {missing}, unexpected {unexpected}")
    return hf.eval()


def hf_forward(hf, pixels, grid):
    """The reference's output laid out as ours: [main | DeepStack levels...]."""
    out = hf(pixels, grid_thw=grid)
    main = getattr(out, "pooler_output", out)
    levels = list(getattr(out, "deepstack_features", None) or [])
    return torch.cat([main, *levels], dim=1) if levels else main


PEAK_TFLOPS = 769.0   # bf16 dense matmul measured on the H200 (README of the GPU facts)


def full_attention_flops(vision: dict, grid: tuple[int, int, int]) -> float | None:
    """Forward FLOPs of one image through a tower whose every block attends
    over the whole image (None for windowed towers): patch embedding,
    blocks (projections, MLP, attention), the merger and DeepStack mergers."""
    if vision.get("window_size") or vision.get("fullatt_block_indexes"):
        return None
    t, h, w = grid
    rows, hid, mlp = t * h * w, vision["hidden_size"], vision["intermediate_size"]
    merge = vision["spatial_merge_size"] ** 2
    patch = 3 * vision["temporal_patch_size"] * vision["patch_size"] ** 2
    block = rows * 2 * (4 * hid * hid + 2 * hid * mlp) + 2 * 2 * rows * rows * hid
    mergers = 1 + len(vision.get("deepstack_visual_indexes") or [])
    merger = (rows // merge) * 2 * (merge * hid * merge * hid + merge * hid * vision["out_hidden_size"])
    return rows * 2 * patch * hid + vision["depth"] * block + mergers * merger


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def median_ms(work, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        _sync()
        t = time.perf_counter()
        work()
        _sync()
        times.append((time.perf_counter() - t) * 1000)
    return float(np.median(times))


def compare(got: torch.Tensor, want: torch.Tensor) -> dict:
    diff = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item()
    return {"max_abs_diff": diff, "ref_max_abs": scale, "ok": diff <= 3e-2 * max(scale, 1.0)}


def run(device: torch.device, shape: str, batches: list[int], size: int, report: dict) -> None:
    tower = random_model(shape, torch.bfloat16, device, part="visual").model
    config = ImageProcessorConfig.from_checkpoint(shape_model_dir(shape))
    flops = full_attention_flops(shape_config(shape)["vision_config"], image_grid_thw(size, size, config))
    report["tflop_per_image"] = flops / 1e12 if flops else None
    try:
        hf = hf_tower(shape, tower, device)
    except Exception:  # recorded; the graph check and our timings still run
        report["transformers_error"] = traceback.format_exc()
        hf = None
    fused = copy.deepcopy(tower)
    report["fused_kernels"] = fuse_vision_tower(fused, device)
    # Off the GPU (a dry run of this script) the eager tower stands in.
    graphs = fused
    if device.type == "cuda":
        graphs = VisionGraphs(fused, device, max_graphs=8)
        started = time.monotonic()
        report["warm_graphs"] = graphs.warm([image_grid_thw(size, size, config)])   # pieces of 1..16 images
        report["warm_s"] = time.monotonic() - started
    for b in batches:
        pixels, grid = preprocess_images(images(b, size), config)
        pixels, grid = pixels.to(device), grid.to(device)
        grids = [tuple(g) for g in grid.tolist()]
        row = report.setdefault(f"batch{b}", {})
        try:
            with torch.inference_mode():
                eager = torch.cat(tower(pixels, grids))
                fused_out = torch.cat(fused(pixels, grids))
                row["fused_vs_eager"] = compare(fused_out, eager)
                row["graph_vs_fused"] = compare(torch.cat(graphs(pixels, grids)), fused_out)
                row["eager_ms_per_image"] = median_ms(lambda: tower(pixels, grids), 5) / b
                row["fused_ms_per_image"] = median_ms(lambda: fused(pixels, grids), 5) / b
                row["graph_ms_per_image"] = median_ms(lambda: graphs(pixels, grids), 10) / b
                row["fused_speedup"] = row["eager_ms_per_image"] / row["fused_ms_per_image"]
                row["graph_speedup_over_fused"] = row["fused_ms_per_image"] / row["graph_ms_per_image"]
                best = min(row["eager_ms_per_image"], row["fused_ms_per_image"], row["graph_ms_per_image"])
                if flops:
                    row["peak_share"] = flops / (best / 1000) / (PEAK_TFLOPS * 1e12)
                if hf is not None:
                    want = hf_forward(hf, pixels, grid)
                    row["vs_transformers"] = compare(eager, want)
                    row["fused_vs_transformers"] = compare(fused_out, want)
                    row["transformers_ms_per_image"] = median_ms(lambda: hf_forward(hf, pixels, grid), 3) / b
                    row["fused_vs_transformers_speed"] = row["transformers_ms_per_image"] / row["fused_ms_per_image"]
        except Exception:  # recorded; the next batch size still runs
            row["error"] = traceback.format_exc()
        print(f"batch {b}:", json.dumps(row), flush=True)
    if device.type == "cuda":
        try:
            mixed_sizes(fused, graphs, config, device, report)
        except Exception:  # recorded
            report.setdefault("mixed_sizes", {})["error"] = traceback.format_exc()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--json", type=Path)
    p.add_argument("--shape", default="qwen2.5-vl-3b", help="a named shape of pipeline/models/shape_configs.py")
    p.add_argument("--batches", default="1,4,8,16")
    p.add_argument("--image-size", type=int, default=640)
    p.add_argument("--device", default="cuda:0", help="cpu: a dry run of the script")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report: dict = {"device": name, "torch": torch.__version__, "shape": args.shape, "image_size": args.image_size}
    try:
        run(device, args.shape, [int(b) for b in args.batches.split(",")], args.image_size, report)
    except Exception:
        report["error"] = traceback.format_exc()
        print(report["error"], flush=True)
    failed = [k for k, v in report.items() if isinstance(v, dict) and
              ("error" in v or not all(c.get("ok", True) for c in v.values() if isinstance(c, dict)))]
    report["failed"] = failed + [k for k in ("error", "transformers_error") if k in report]
    print("failed:", report["failed"], flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
