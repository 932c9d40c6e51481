#!/usr/bin/env python3
"""The encoder stage on a GPU, end to end (run on the GPU box, not in CI):

    python scripts/gpu_encoder_smoke.py --encoder-device 0 --consumer-device 1

Starts `python -m stages.encoder` on the tiny model with a CUDA arena, sends
it image jobs, reads the embeddings through the arena onto the consumer's GPU,
and compares them with the vision tower run in this process (bf16 tolerance).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import zmq.asyncio  # noqa: E402
from PIL import Image  # noqa: E402

from pipeline import protocol, transport  # noqa: E402
from pipeline.arena.reader import ArenaReader  # noqa: E402
from pipeline.hashing import content_hash, media_salt  # noqa: E402
from pipeline.models.loader import load_model  # noqa: E402
from pipeline.models.tiny import default_model_dir  # noqa: E402
from pipeline.processing.image import (  # noqa: E402
    ImageProcessorConfig, num_visual_tokens, open_image, preprocess_images)


def jpeg(seed: int, h: int, w: int) -> bytes:
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (h // 8, w // 8, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(small).resize((w, h), Image.BILINEAR).save(buf, "JPEG", quality=90)
    return buf.getvalue()


async def run(args) -> int:
    model_dir = default_model_dir()
    run_dir = Path(f"/tmp/epd-smoke-{os.getpid()}")
    run_dir.mkdir(exist_ok=True)
    enc_addr, me = f"ipc://{run_dir}/enc.sock", f"ipc://{run_dir}/me.sock"
    proc = subprocess.Popen([sys.executable, "-m", "stages.encoder", "--address", enc_addr,
                             "--device", f"cuda:{args.encoder_device}", "--media-backend", args.media,
                             "--instance", "smoke", "--model-id", "tiny"], cwd=REPO)
    ctx = zmq.asyncio.Context()
    inbox, outbox = transport.Inbox(ctx, me), transport.Outbox(ctx)
    device = torch.device(f"cuda:{args.consumer_device}")
    reader = ArenaReader(device)
    torch.cuda.set_device(device)
    failures = 0
    try:
        announce = None
        while announce is None:
            outbox.send(enc_addr, protocol.Hello("smoke", me))
            try:
                announce = await asyncio.wait_for(inbox.recv(), 1.0)
            except asyncio.TimeoutError:
                if proc.poll() is not None:
                    raise RuntimeError("encoder exited") from None
        reader.open(announce.arena)
        cfg = ImageProcessorConfig.from_checkpoint(model_dir)
        salt = media_salt("tiny", cfg.settings_key())
        tower = load_model(model_dir, dtype="bfloat16", device=str(device), part="visual").model
        images = [jpeg(i, 224 + 56 * i, 336 - 28 * i) for i in range(6)]
        t0 = time.perf_counter()
        for i, media in enumerate(images):
            im = open_image(media, cfg)
            outbox.send(enc_addr, protocol.EncodeJob(f"j{i}", f"r{i}", content_hash(media, salt), media, me,
                                                     num_visual_tokens(im.height, im.width, cfg)))
        for _ in images:
            msg = await asyncio.wait_for(inbox.recv(), 60)
            while isinstance(msg, protocol.EncoderAnnounce):  # answers to our repeated hellos
                msg = await asyncio.wait_for(inbox.recv(), 60)
            if not isinstance(msg, protocol.EmbeddingReady):
                print("unexpected", msg)
                failures += 1
                continue
            got = reader.read(msg.handle, device=device)
            i = int(msg.job_id[1:])
            # Compare with the Pillow-exact pixels through our own tower; the
            # encoder's GPU decoder differs within the media tolerance, so
            # allow for that plus bf16 rounding.
            pixels, grid = preprocess_images([open_image(images[i], cfg)], cfg)
            with torch.no_grad():
                ref = tower(pixels.to(device), [tuple(grid[0].tolist())])[0]
            err = (got.float() - ref.float()).abs().max().item() / ref.float().abs().max().item()
            print(f"image {i}: {tuple(got.shape)} on {got.device}, relative max error {err:.4f}")
            failures += err > args.tolerance
            outbox.send(enc_addr, protocol.ReleaseLease((msg.lease_id,), me))
        print(f"{len(images)} images in {1000 * (time.perf_counter() - t0):.1f} ms; failures: {failures}")
    finally:
        reader.close()
        inbox.close()
        outbox.close()
        ctx.term()
        proc.terminate()
        print("encoder exit code", proc.wait(timeout=30))
        left = [p.name for p in Path("/dev/shm").glob("epd-smoke-*")]
        print("shm leftovers:", left)
        failures += bool(left)
    return 1 if failures else 0


def main() -> int:
    import faulthandler

    faulthandler.enable()
    p = argparse.ArgumentParser()
    p.add_argument("--encoder-device", type=int, default=0)
    p.add_argument("--consumer-device", type=int, default=0)
    # Pillow by default: the encoder then sees exactly our pixels, so any
    # difference is the transport's. A GPU decoder adds its own (docs/media.md).
    p.add_argument("--media", default="pillow")
    p.add_argument("--tolerance", type=float, default=0.02)
    args = p.parse_args()
    transport.install_event_loop()
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())
