"""Generated video clips for the `random-mm` workload's video buckets
`(H, W, T)` with T > 1: T frames at CLIP_FPS of a smooth gradient with a
moving square, H.264 in MP4 (MPEG-4 part 2 where libx264 is missing).

As with images (dataset.py), a few clips per bucket are encoded once per
process and every clip sent is one of them made unique by a trailing MP4
`free` box holding a nonce: demuxers skip `free` boxes, the server hashes
bytes, so each nonce is a full decode and encode while no request pays for
an H.264 encode. Smooth frames keep the files small (noise would not
compress, and a 720p clip of noise is tens of megabytes).
"""

from __future__ import annotations

import base64
import functools
import io
from dataclasses import dataclass

import numpy as np

CLIP_FPS = 30
CLIP_POOL_SIZE = 2
MP4_URL_PREFIX = "data:video/mp4;base64,"


def _frame(index: int, height: int, width: int, pool_index: int) -> np.ndarray:
    y, x = np.mgrid[0:height, 0:width]
    shade = (pool_index * 53) % 256
    rgb = np.stack([(x * 255 // max(width - 1, 1) + index) % 256, (y * 255 // max(height - 1, 1)) % 256,
                    np.full_like(x, shade)], axis=-1).astype(np.uint8)
    side = max(4, min(height, width) // 5)
    top, left = (index * 3) % max(height - side, 1), (index * 5) % max(width - side, 1)
    rgb[top:top + side, left:left + side] = (255 - shade, shade, 128)
    return rgb


@functools.lru_cache(maxsize=None)
def pooled_clip(height: int, width: int, frames: int, pool_index: int) -> bytes:
    """Pool clip `pool_index` of this bucket, encoded once per process."""
    import av   # the bench's video buckets only: image-only runs need no PyAV

    codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream(codec, rate=CLIP_FPS)
        # Even sides: the 4:2:0 pixel format needs them (an odd side is rounded up).
        stream.width, stream.height = width + width % 2, height + height % 2
        stream.pix_fmt = "yuv420p"
        for index in range(frames):
            frame = av.VideoFrame.from_ndarray(_frame(index, stream.height, stream.width, pool_index),
                                               format="rgb24")
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buffer.getvalue()


@dataclass(frozen=True)
class GeneratedClip:
    """A clip's recipe: a pool clip plus the nonce that makes its bytes unique."""

    height: int
    width: int
    frames: int
    pool_index: int
    nonce: str

    def data(self) -> bytes:
        payload = self.nonce.encode("ascii")
        free_box = (8 + len(payload)).to_bytes(4, "big") + b"free" + payload
        return pooled_clip(self.height, self.width, self.frames, self.pool_index) + free_box

    def content_part(self) -> dict:
        url = MP4_URL_PREFIX + base64.b64encode(self.data()).decode("ascii")
        return {"type": "video_url", "video_url": {"url": url}}
