#!/usr/bin/env python3
"""Where the vision tower's time goes on a GPU (run on the GPU box, not in
CI): one eager forward of a batch of 640x640 images through our tower of a
named shape (--shape, default Qwen2.5-VL-3B; random bf16 weights made on the GPU), on the
fused kernels the stages use (--plain: plain PyTorch ops), under
torch.profiler; prints the kernels by GPU time, their share, and the
tower's achieved TFLOP/s from its matmul FLOPs.

    python3 scripts/gpu_vision_profile.py [--shape qwen3-vl-4b] [--batch 16] [--plain] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from gpu_vision_check import images  # noqa: E402
from pipeline.models.shape_folder import shape_model_dir  # noqa: E402
from pipeline.models.shapes import random_model  # noqa: E402
from pipeline.models.vision_flags import fuse_vision_tower  # noqa: E402
from pipeline.processing.image import ImageProcessorConfig, preprocess_images  # noqa: E402


def matmul_flops(tower: torch.nn.Module, tokens: int) -> float:
    """2 * rows * weights of every Linear: the blocks' see every patch, the
    mergers' (DeepStack's too) a quarter of them. Attention scores and the patch embedding's
    convolution are left out."""
    flops = 0.0
    for name, module in tower.named_modules():
        if isinstance(module, torch.nn.Linear):
            rows = tokens // 4 if "merger" in name.split(".")[0] else tokens
            flops += 2.0 * rows * module.in_features * module.out_features
    return flops


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--plain", action="store_true", help="plain PyTorch ops, not the fused kernels")
    p.add_argument("--json", type=Path)
    p.add_argument("--shape", default="qwen2.5-vl-3b")
    args = p.parse_args()
    device = torch.device("cuda:0")
    tower = random_model(args.shape, torch.bfloat16, device, part="visual").model
    fused = not args.plain and fuse_vision_tower(tower, device)
    config = ImageProcessorConfig.from_checkpoint(shape_model_dir(args.shape))
    pixels, grid = preprocess_images(images(args.batch), config)
    pixels = pixels.to(device)
    grids = [tuple(g) for g in grid.tolist()]
    with torch.inference_mode():
        for _ in range(3):
            tower(pixels, grids)
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(5):
            tower(pixels, grids)
        torch.cuda.synchronize()
        forward_s = (time.perf_counter() - started) / 5
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            tower(pixels, grids)
            torch.cuda.synchronize()
    tokens = pixels.shape[0]
    report = {"batch": args.batch, "patches": tokens, "fused": fused, "forward_ms": forward_s * 1000,
              "ms_per_image": forward_s * 1000 / args.batch,
              "matmul_tflops": matmul_flops(tower, tokens) / forward_s / 1e12}
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    total = sum(e.self_device_time_total for e in events)
    report["gpu_busy_ms"] = total / 1000
    report["kernels"] = [{"name": e.key[:120], "calls": e.count, "ms": e.self_device_time_total / 1000,
                          "share": e.self_device_time_total / total} for e in events[:args.top]]
    print(json.dumps({k: v for k, v in report.items() if k != "kernels"}), flush=True)
    for k in report["kernels"]:
        print(f"{k['share']:6.1%} {k['ms']:8.2f} ms {k['calls']:6d}x  {k['name']}")
    ops = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
    print(ops)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
