#!/usr/bin/env python3
"""NVDEC through DALI against PyAV on the CPU, in one run (issue 16):

    python3 scripts/gpu_video_check.py [--json OUT.json] [--seconds 8] [--repeats 3]
    python3 scripts/gpu_video_check.py --device cpu --codec libvpx-vp9   # a CPU smoke test

For 640x360 and 1280x720 clips (H.264, 30 fps, B-frames, made here with
PyAV: epd-bench's generated clips):
- full decode: every frame to RGB, frames per second, PyAV (threaded, CPU)
  against DALI's decoder (NVDEC on CUDA);
- the serving path: each backend's `decode` of a batch of clips at the
  family's sampling (2 frames a second) with preprocessing, clips per second;
- agreement: DALI's frames against PyAV's in uint8 levels, and the
  preprocessed pixel values in normalised units against the backend's stated
  tolerance, for both families' processors.
Prints one JSON object (and writes it with --json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.bench.clips import CLIP_FPS, pooled_clip  # noqa: E402
from pipeline.media.base import Tolerance  # noqa: E402
from pipeline.media.dali_backend import _import_dali  # noqa: E402
from pipeline.media.dali_video import DaliVideoBackend  # noqa: E402
from pipeline.media.video_backend import PyAVVideoBackend, VideoClip  # noqa: E402
from pipeline.media.video_probe import decode_frames, probe_video  # noqa: E402
from pipeline.processing.video import VideoOptions  # noqa: E402
from pipeline.processing.video_config import INTERVAL_VIDEO_DEFAULTS, TIMESTAMP_VIDEO_DEFAULTS  # noqa: E402

SIZES = ((360, 640), (720, 1280))
CONFIGS = {"interval (Qwen2.5-VL), fps 2": (INTERVAL_VIDEO_DEFAULTS, VideoOptions(fps=2.0, num_frames=None)),
           "timestamp (Qwen3-VL), defaults": (TIMESTAMP_VIDEO_DEFAULTS, None)}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path)
    p.add_argument("--seconds", type=float, default=8.0, help="clip length")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch", type=int, default=8, help="clips per serving-path decode call")
    p.add_argument("--device", default="cuda")
    p.add_argument("--codec", default="libx264", help="libx264 (NVDEC) or libvpx-vp9 (DALI's CPU decoder too)")
    return p.parse_args(argv)


def make_clip(height: int, width: int, frames: int, codec: str, pool_index: int) -> bytes:
    if codec == "libx264":
        return pooled_clip(height, width, frames, pool_index)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from video_clips import write_clip   # VP9 in WebM, for the CPU smoke test

    return write_clip(frames, CLIP_FPS, width, height, codec=codec, container="webm", seed=pool_index).data


def timed(fn, repeats: int, sync) -> tuple[float, object]:
    """Median seconds of `repeats` calls after one warm-up, and the last result."""
    result = fn()
    sync()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        result = fn()
        sync()
        times.append(time.perf_counter() - started)
    return statistics.median(times), result


def full_decode(data: bytes, frames: int, device: torch.device, repeats: int, sync) -> dict:
    ndd, _ = _import_dali()
    pyav_s, reference = timed(lambda: decode_frames(data, range(frames), frames), repeats, sync)
    op = "gpu" if device.type == "cuda" else "cpu"
    ctx = (ndd.EvalContext(num_threads=4, device_id=device.index or 0) if device.type == "cuda"
           else ndd.EvalContext(num_threads=4))

    def dali():
        with ctx:
            batch = ndd.as_batch([np.frombuffer(data, dtype=np.uint8)])
            return ndd.decoders.video(batch, device=op).evaluate().tensors[0].torch()

    dali_s, ours = timed(dali, repeats, sync)
    ours = ours.cpu().numpy().astype(np.int16)
    diff = np.abs(ours - reference.astype(np.int16)) if ours.shape == reference.shape else None
    return {"frames": frames, "pyav_fps": round(frames / pyav_s, 1), "dali_fps": round(frames / dali_s, 1),
            "dali_over_pyav": round(pyav_s / dali_s, 2), "shapes_equal": diff is not None,
            "levels_max_abs": None if diff is None else int(diff.max()),
            "levels_mean_abs": None if diff is None else round(float(diff.mean()), 3),
            "levels_mean_signed_per_channel": None if diff is None else
            [round(float(v), 3) for v in (ours - reference).reshape(-1, 3).mean(0)]}


def serving_path(clips: list[bytes], reference: PyAVVideoBackend, dali: DaliVideoBackend, repeats: int,
                 sync) -> dict:
    out = {}
    for name, (cfg, options) in CONFIGS.items():
        batch = [VideoClip(data, options) for data in clips]
        pyav_s, want = timed(lambda: reference.decode(batch, cfg), repeats, sync)
        dali_s, got = timed(lambda: dali.decode(batch, cfg), repeats, sync)
        measured = [Tolerance.measure(g.pixel_values, w.pixel_values) for g, w in zip(got, want)]
        worst = (max(m[0] for m in measured), max(m[1] for m in measured))
        out[name] = {"sampled_frames": len(want[0].plan.frame_indices), "grid": list(want[0].plan.grid),
                     "tokens": want[0].plan.num_tokens, "pyav_clips_per_s": round(len(batch) / pyav_s, 2),
                     "dali_clips_per_s": round(len(batch) / dali_s, 2), "dali_over_pyav": round(pyav_s / dali_s, 2),
                     "max_abs": round(worst[0], 4), "mean_abs": round(worst[1], 5),
                     "within_tolerance": dali.tolerance.allows(*worst),
                     "tolerance": [dali.tolerance.max_abs, dali.tolerance.mean_abs],
                     "fallbacks": dali.fallbacks}
    return out


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    frames = round(args.seconds * CLIP_FPS)
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "codec": args.codec, "seconds": args.seconds, "fps": CLIP_FPS, "sizes": {}}
    with PyAVVideoBackend() as reference, DaliVideoBackend(device) as dali:
        for height, width in SIZES:
            clips = [make_clip(height, width, frames, args.codec, i) for i in range(2)]
            header = probe_video(clips[0])
            entry = {"bytes": len(clips[0]), "codec": header.codec, "header_frames": header.total_frames,
                     "full_decode": full_decode(clips[0], header.total_frames, device, args.repeats, sync)}
            # The batch: the pool's clips, each made unique as epd-bench does (a trailing free box).
            batch = [clips[i % 2] + (16).to_bytes(4, "big") + b"free" + i.to_bytes(8, "big")
                     for i in range(args.batch)]
            entry["serving_path"] = serving_path(batch, reference, dali, args.repeats, sync)
            report["sizes"][f"{width}x{height}"] = entry
            print(json.dumps({f"{width}x{height}": entry}), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
