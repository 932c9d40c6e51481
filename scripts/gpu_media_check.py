#!/usr/bin/env python3
"""Check the GPU media backends against the Pillow reference, and time them.

    python scripts/gpu_media_check.py                 # on the GPU box: dali + nvjpeg on cuda
    python scripts/gpu_media_check.py --device cpu    # DALI's CPU mode + torch's resize, no GPU

For each backend that can run (DALI when importable; torchvision nvJPEG on
CUDA) it decodes synthetic photo-like JPEGs and PNGs of several sizes, up- and
downscaled, and compares pixel_values with the Pillow backend's (which is
bit-exact with the reference processor). With --device cpu it also measures
"torch-resize": Pillow decode + the torch resize the nvJPEG backend uses, so
that backend's resampling error is known without a GPU. Then it times batches
of 640x640 JPEGs against the Pillow backend in the same run.

Exits 1 when any difference exceeds the backend's documented tolerance, 2 when
no backend other than Pillow could run.
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image, ImageDraw  # noqa: E402

from pipeline.media import registry  # noqa: E402
from pipeline.media.base import DecodedImage, MediaBackend, Tolerance  # noqa: E402
from pipeline.media.nvjpeg_backend import RESIZE_TOLERANCE  # noqa: E402
from pipeline.media.patches import normalize_table, patchify, resize_bicubic  # noqa: E402
from pipeline.media.pillow_backend import PillowBackend, decode_rgb  # noqa: E402
from pipeline.media.probe import probe  # noqa: E402
from pipeline.processing.image import ImageProcessorConfig  # noqa: E402

# (height, width): upscaled, identity, near-identity, downscaled, extreme aspect.
SIZES = [(37, 91), (91, 37), (224, 224), (300, 500), (640, 640), (720, 1280),
         (1080, 1920), (3024, 4032), (64, 1500)]
FORMATS = ["JPEG-q90", "JPEG-q75-progressive", "PNG", "PNG-RGBA"]


def scene(height: int, width: int, seed: int) -> Image.Image:
    """A photo-like test image: smooth colour fields plus hard edges and text,
    which is where resamplers and IDCTs disagree most."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (max(1, height // 16), max(1, width // 16), 3), dtype=np.uint8)
    image = Image.fromarray(small).resize((width, height), Image.BICUBIC)
    draw = ImageDraw.Draw(image)
    for _ in range(12):
        x0, x1 = sorted(rng.integers(0, width, 2))
        y0, y1 = sorted(rng.integers(0, height, 2))
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        shape = (draw.rectangle, draw.ellipse, draw.line)[int(rng.integers(3))]
        if shape is draw.line:
            draw.line([(x0, y0), (x1, y1)], fill=colour, width=int(rng.integers(1, 4)))
        else:
            shape([x0, y0, x1, y1], fill=colour)
    for row in range(0, height, 24):
        draw.text((4, row), "EPD media check 0123456789", fill=(255, 255, 255))
    noise = rng.normal(0, 4, (height, width, 3))
    return Image.fromarray(np.clip(np.asarray(image) + noise, 0, 255).astype(np.uint8))


def encode(image: Image.Image, fmt: str, seed: int) -> bytes:
    buf = io.BytesIO()
    if fmt == "JPEG-q90":
        image.save(buf, "JPEG", quality=90)
    elif fmt == "JPEG-q75-progressive":
        image.save(buf, "JPEG", quality=75, progressive=True)
    elif fmt == "PNG":
        image.save(buf, "PNG")
    else:  # RGBA with a gradient alpha, composited onto white by the reference
        alpha = np.linspace(0, 255, image.width, dtype=np.uint8)[None, :].repeat(image.height, 0)
        rgba = image.copy()
        rgba.putalpha(Image.fromarray(alpha))
        rgba.save(buf, "PNG")
    return buf.getvalue()


def test_set() -> list[tuple[str, bytes]]:
    out = []
    for i, (height, width) in enumerate(SIZES):
        image = scene(height, width, seed=i)
        for fmt in FORMATS:
            out.append((f"{width}x{height} {fmt}", encode(image, fmt, i)))
    return out


class TorchResize:
    """Pillow decode + the nvJPEG backend's torch resize, on any device: isolates
    the resampling part of that backend's error."""

    name = "torch-resize"
    tolerance = RESIZE_TOLERANCE

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def decode(self, blobs: list[bytes], cfg: ImageProcessorConfig) -> list[DecodedImage]:
        table = normalize_table(cfg, self.device)
        out = []
        for blob in blobs:
            header = probe(blob, cfg)
            chw = torch.from_numpy(decode_rgb(blob, cfg)).to(self.device).permute(2, 0, 1)
            rgb = resize_bicubic(chw, *header.resized)
            out.append(DecodedImage(patchify(rgb, cfg, table), header.grid, header.source_size))
        return out


def compare(backend, reference: list[DecodedImage], cases: list[tuple[str, bytes]],
            cfg: ImageProcessorConfig) -> bool:
    tol: Tolerance = backend.tolerance
    print(f"\n== {backend.name} on {backend.device}: tolerance max_abs<={tol.max_abs} "
          f"mean_abs<={tol.mean_abs} (normalised units)")
    results = backend.decode([blob for _, blob in cases], cfg)
    ok, worst_max, worst_mean = True, 0.0, 0.0
    for (label, _), ours, ref in zip(cases, results, reference):
        if not isinstance(ours, DecodedImage) or ours.grid != ref.grid:
            print(f"  FAIL {label}: {ours!r}")
            ok = False
            continue
        max_abs, mean_abs = Tolerance.measure(ours.pixel_values, ref.pixel_values)
        worst_max, worst_mean = max(worst_max, max_abs), max(worst_mean, mean_abs)
        verdict = "ok  " if tol.allows(max_abs, mean_abs) else "FAIL"
        ok &= verdict == "ok  "
        print(f"  {verdict} {label:<32} max_abs={max_abs:.4f} mean_abs={mean_abs:.5f}")
    print(f"  worst: max_abs={worst_max:.4f} mean_abs={worst_mean:.5f} -> {'PASS' if ok else 'FAIL'}")
    return ok


def throughput(backend, blobs: list[bytes], cfg: ImageProcessorConfig, seconds: float) -> float:
    """Images per second, outputs complete on the device."""
    def run() -> None:
        backend.decode(blobs, cfg)
        if backend.device.type == "cuda":
            torch.cuda.synchronize(backend.device)
    run()  # warm-up: operator build, allocator growth
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        run()
        count += len(blobs)
    return count / (time.perf_counter() - start)


def candidates(device: torch.device) -> list[MediaBackend | TorchResize]:
    out: list[MediaBackend | TorchResize] = []
    for name in ("dali", "nvjpeg"):
        reason = registry.unavailable_reason(name, device)
        if reason is None:
            out.append(registry.create_backend(name, device))
        else:
            print(f"skipping {name}: {reason}")
    if device.type == "cpu":
        out.append(TorchResize(device))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=3.0, help="time per throughput measurement")
    args = parser.parse_args()
    device = torch.device(args.device)
    cfg = ImageProcessorConfig()
    pillow = PillowBackend()
    backends = candidates(device)
    if not any(isinstance(b, MediaBackend) for b in backends) and device.type == "cuda":
        print("no GPU media backend could run")
        return 2

    cases = test_set()
    reference = pillow.decode([blob for _, blob in cases], cfg)
    ok = all([compare(backend, reference, cases, cfg) for backend in backends])

    blobs = [encode(scene(640, 640, seed=100 + i), "JPEG-q90", i) for i in range(args.batch)]
    print(f"\n== throughput: batch of {args.batch} 640x640 JPEGs (q90), {args.seconds:.0f} s each")
    rate = throughput(pillow, blobs, cfg, args.seconds)
    print(f"  pillow ({pillow.num_threads} threads, cpu): {rate:8.1f} images/s")
    for backend in backends:
        rate = throughput(backend, blobs, cfg, args.seconds)
        print(f"  {backend.name} ({backend.device}): {rate:8.1f} images/s")
    print("\nRESULT:", "PASS" if ok else "FAIL (a difference exceeds the documented tolerance)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
