"""Small generated video clips for the video tests, written with PyAV.

Each frame has texture for the resize to act on (a diagonal colour ramp with
seeded noise) and a square whose position and colour change with the frame
number, so a wrong frame index or a swapped frame shows in the pixels.
"""

from __future__ import annotations

import io
import tempfile
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import av
import numpy as np

NTSC = Fraction(30000, 1001)


@dataclass(frozen=True)
class Clip:
    """How a clip was written, to compare what the probe reads against."""

    data: bytes
    fps: Fraction
    frames: int
    width: int
    height: int
    codec: str  # the decoder's name, as the probe reports it


def frame_pixels(index: int, width: int, height: int, seed: int) -> np.ndarray:
    """RGB uint8 [height, width, 3] for frame `index`."""
    rng = np.random.default_rng(seed * 100_003 + index)
    y, x = np.mgrid[0:height, 0:width]
    ramp = (x * 255 // max(width - 1, 1) + y * 128 // max(height - 1, 1)) % 256
    rgb = np.stack([ramp, (255 - ramp + 40 * index) % 256, (ramp // 2 + 17 * index) % 256], axis=-1)
    rgb = (rgb + rng.integers(-24, 25, rgb.shape)).clip(0, 255).astype(np.uint8)
    side = max(4, min(width, height) // 4)
    left = (index * 3) % max(width - side, 1)
    top = (index * 2) % max(height - side, 1)
    rgb[top:top + side, left:left + side] = ((index * 37) % 256, 255 - (index * 11) % 256, 90)
    return rgb


def write_clip(frames: int, fps: Fraction | int | float, width: int, height: int, *,
               codec: str = "libx264", container: str = "mp4", faststart: bool = False,
               gop: int | None = None, seed: int = 0) -> Clip:
    """Encode `frames` generated frames at `fps`; the container file's bytes.

    faststart puts the index (moov) before the media data, so a truncated file
    still opens and fails only while decoding; gop sets the keyframe interval.
    """
    rate = Fraction(fps).limit_denominator(1001)
    with tempfile.TemporaryDirectory() as folder:
        # A file, not a buffer: the faststart pass reopens the output by name to move the index.
        path = Path(folder) / f"clip.{container}"
        _encode(path, frames, rate, width, height, codec, container, faststart, gop, seed)
        data = path.read_bytes()
    decoder = {"libx264": "h264"}.get(codec, codec)
    return Clip(data, rate, frames, width, height, decoder)


def _encode(path: Path, frames: int, rate: Fraction, width: int, height: int, codec: str, container: str,
            faststart: bool, gop: int | None, seed: int) -> None:
    options = {"movflags": "faststart"} if faststart else {}
    with av.open(str(path), mode="w", format=container, options=options) as out:
        stream = out.add_stream(codec, rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        if gop is not None:
            stream.codec_context.gop_size = gop
        if codec == "libx264":
            # One thread: the same bytes every run. veryfast keeps B-frames, so decode
            # order differs from presentation order, as in real clips.
            stream.codec_context.options = {"preset": "veryfast", "threads": "1"}
        for index in range(frames):
            image = av.VideoFrame.from_ndarray(frame_pixels(index, width, height, seed), format="rgb24")
            out.mux(stream.encode(image))
        out.mux(stream.encode())


def write_empty_clip() -> bytes:
    """An AVI whose video stream header is there but holds no frames (an mp4
    muxer drops a track without samples; AVI keeps it)."""
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="avi") as out:
        stream = out.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        out.start_encoding()
    return buffer.getvalue()


def decode_all(data: bytes) -> np.ndarray:
    """Every frame, decoded in order without seeking: [N, H, W, 3] uint8."""
    with av.open(io.BytesIO(data)) as container:
        return np.stack([frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)])
