"""Video bytes on the CPU with PyAV: the container header, then chosen frames as RGB.

`probe_video` reads the stream metadata the way the reference's PyAV reader
does (frame count from the header, frame rate = the stream's average rate,
duration = frames / rate) without decoding a frame; only a header with no
frame count makes it walk the packets. `decode_frames` decodes the frames a
plan asked for. Frame i is the i-th frame the decoder outputs from the
start, as in the reference; seeking to a keyframe is only a shortcut taken
where the packet index proves it lands on the same frames.
"""

from __future__ import annotations

import io
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction

import av
import numpy as np

__all__ = ["ProbeLimits", "VideoDecodeError", "VideoHeader", "decode_frames", "probe_video"]

# Demuxers a request may use; image demuxers (png_pipe, image2, ...) are refused
# here so that a still image never passes for a one-frame video.
ALLOWED_CONTAINERS = ("mov,mp4,m4a,3gp,3g2,mj2", "matroska,webm", "avi", "mpegts")
# Demuxers that seek through a sample index; MPEG-TS seeks by byte estimates,
# which land on other frames than asked, so it is always decoded in order.
SEEKABLE_CONTAINERS = ("mov,mp4,m4a,3gp,3g2,mj2", "matroska,webm", "avi")
# Codecs both this decoder and the GPU decoders (NVDEC) handle.
ALLOWED_CODECS = ("h264", "hevc", "vp8", "vp9", "av1", "mpeg4", "mpeg1video", "mpeg2video")


class VideoDecodeError(ValueError):
    """Video bytes cannot be used; the message says why in one line."""


@dataclass(frozen=True)
class ProbeLimits:
    """Refuse clips over these before decoding (decompression and cost bombs)."""

    max_frame_pixels: int = 8192 * 4320
    max_total_frames: int = 216_000  # two hours at 30 frames a second


@dataclass(frozen=True)
class VideoHeader:
    """What the container header says about its first video stream.

    fps and duration are the reference's: the stream's average frame rate
    and total_frames / fps; stream_duration is the container's own figure
    (None when it gives none); frames_counted is True when the header had no
    frame count and the packets were counted instead.
    """

    container: str
    codec: str
    width: int
    height: int
    fps: float
    total_frames: int
    duration: float
    stream_duration: float | None
    frames_counted: bool

    @property
    def size(self) -> tuple[int, int]:
        return self.height, self.width


def _as_bytes(data: bytes) -> bytes:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"video data must be bytes, got {type(data).__name__}")
    if len(data) == 0:
        raise VideoDecodeError("empty video data (0 bytes)")
    return bytes(data) if isinstance(data, memoryview) else data


def _open(data: bytes) -> av.container.InputContainer:
    data = _as_bytes(data)
    try:
        # Metadata is never used here; a tag that is not UTF-8 must not fail the
        # open with UnicodeDecodeError (PyAV decodes every tag strictly by default).
        container = av.open(io.BytesIO(data), mode="r", metadata_errors="replace")
    except av.FFmpegError as exc:
        raise VideoDecodeError(f"not a readable video ({len(data)} bytes; truncated or not a video): "
                               f"{exc.strerror or exc}") from None
    if container.format.name not in ALLOWED_CONTAINERS:
        name = container.format.name
        container.close()
        raise VideoDecodeError(f"unsupported container {name!r} (an image or another non-video format?); "
                               f"supported: mp4/mov, matroska/webm, avi, mpegts")
    return container


def _video_stream(container: av.container.InputContainer) -> av.video.stream.VideoStream:
    if not container.streams.video:
        raise VideoDecodeError("the container has no video stream (no frames?)")
    stream = container.streams.video[0]
    if stream.codec_context is None:   # a codec id FFmpeg has no decoder for (or none at all)
        raise VideoDecodeError(f"the video stream's codec is unknown; supported: {', '.join(ALLOWED_CODECS)}")
    codec = stream.codec_context.name
    if codec not in ALLOWED_CODECS:
        raise VideoDecodeError(f"unsupported video codec {codec!r}; supported: {', '.join(ALLOWED_CODECS)}")
    return stream


def _media_packets(container: av.container.InputContainer, stream) -> Iterator[av.Packet]:
    """Packets that carry a frame the decoder outputs (not flush or discarded ones)."""
    try:
        for packet in container.demux(stream):
            if packet.size and not packet.is_discard:
                yield packet
    except av.FFmpegError as exc:
        raise VideoDecodeError(f"corrupt video container: {exc.strerror or exc}") from None


def _seconds(value: int | None, time_base: Fraction | None) -> float | None:
    return None if value is None or time_base is None else float(value * time_base)


def probe_video(data: bytes, limits: ProbeLimits = ProbeLimits()) -> VideoHeader:
    """The header of `data`'s first video stream; VideoDecodeError for bytes
    that are no video, an unsupported container or codec, no frames, no frame
    rate, or a clip over `limits`."""
    with _open(data) as container:
        stream = _video_stream(container)
        width, height = stream.width, stream.height
        if width < 1 or height < 1:
            raise VideoDecodeError(f"video stream has no picture size ({width}x{height})")
        if width * height > limits.max_frame_pixels:
            raise VideoDecodeError(f"video frames too large: {width}x{height}, over the limit of "
                                   f"{limits.max_frame_pixels} pixels")
        rate = stream.average_rate
        total, counted = stream.frames, False
        if total <= 0:
            total, counted = sum(1 for _ in _media_packets(container, stream)), True
        if total <= 0:
            raise VideoDecodeError("the video stream has no frames")
        if total > limits.max_total_frames:
            raise VideoDecodeError(f"video too long: {total} frames, over the limit of {limits.max_total_frames}")
        if not rate:
            raise VideoDecodeError("the video stream states no frame rate")
        stream_duration = _seconds(stream.duration, stream.time_base)
        if stream_duration is None and container.duration is not None:
            stream_duration = container.duration / av.time_base
        fps = float(rate)
        return VideoHeader(container=container.format.name, codec=stream.codec_context.name, width=width,
                           height=height, fps=fps, total_frames=int(total), duration=total / fps,
                           stream_duration=stream_duration, frames_counted=counted)


# ---------------------------------------------------------------- decoding

@dataclass(frozen=True)
class _PacketIndex:
    """Presentation order of the stream's frames, and where seeking is safe.

    pts[r] is frame r's timestamp; seek_ranks are the keyframes from which
    every later-presented frame is also later in decode order, so decoding
    from one of them yields every frame from it on.
    """

    pts: tuple[int, ...]
    seek_ranks: tuple[int, ...]


def _h264_idr(packet: av.Packet, length_size: int) -> bool:
    """Whether an H.264 packet holds an IDR slice (NAL type 5).

    Only an IDR empties the reference list; other H.264 "keyframes" (an I
    slice with a recovery point) may be followed by frames that refer back
    past them, so seeking there would decode different pixels.
    """
    data = bytes(packet)
    if length_size:  # length-prefixed NAL units (mp4, matroska)
        pos = 0
        while pos + length_size < len(data):
            size = int.from_bytes(data[pos:pos + length_size], "big")
            if data[pos + length_size] & 0x1F == 5:
                return True
            pos += length_size + size
        return False
    pos = data.find(b"\x00\x00\x01")  # start codes (mpegts)
    while 0 <= pos < len(data) - 3:
        if data[pos + 3] & 0x1F == 5:
            return True
        pos = data.find(b"\x00\x00\x01", pos + 3)
    return False


def _nal_length_size(stream) -> int:
    """Bytes of each NAL length prefix (0 for start codes), from the avcC record."""
    extradata = stream.codec_context.extradata or b""
    return (extradata[4] & 3) + 1 if len(extradata) > 4 and extradata[0] == 1 else 0


def _packet_index(container, stream, total_frames: int) -> _PacketIndex | None:
    """The index, or None when the packets do not map one to one onto frames."""
    h264 = stream.codec_context.name == "h264"
    length_size = _nal_length_size(stream) if h264 else 0
    packets = []
    for p in _media_packets(container, stream):
        key = p.is_keyframe and (not h264 or _h264_idr(p, length_size))
        packets.append((p.pts, p.dts, key))
    if len(packets) != total_frames or any(pts is None or dts is None for pts, dts, _ in packets):
        return None
    order = sorted(packets)
    if len({pts for pts, _, _ in order}) != len(order):
        return None
    suffix_min_dts, lowest = [0] * len(order), None
    for rank in range(len(order) - 1, -1, -1):
        dts = order[rank][1]
        lowest = dts if lowest is None else min(lowest, dts)
        suffix_min_dts[rank] = lowest
    seek = tuple(r for r, (_, dts, key) in enumerate(order) if key and suffix_min_dts[r] >= dts)
    return _PacketIndex(tuple(pts for pts, _, _ in order), seek)


class _SeekMismatch(Exception):
    """Decoding after a seek did not produce the frames the index predicted."""


def _rgb(frame: av.VideoFrame) -> np.ndarray:
    return frame.to_ndarray(format="rgb24")


def _decode_in_order(data: bytes, wanted: list[int]) -> dict[int, np.ndarray]:
    """The reference's way: count decoded frames from the start."""
    found: dict[int, np.ndarray] = {}
    wanted_set, last = set(wanted), wanted[-1]
    with _open(data) as container:
        stream = _video_stream(container)
        stream.thread_type = "AUTO"
        for i, frame in enumerate(container.decode(stream)):
            if i in wanted_set:
                found[i] = _rgb(frame)
            if i >= last:
                break
    return found


def _decode_from(frames, keyframe: int, target: int, expected: int | None, rank_of: dict[int, int],
                 wanted: set[int], found: dict[int, np.ndarray]) -> None:
    """Decode on until frame `target`. Right after a seek (`expected` None) the
    first frame must come at or before `keyframe`; from then on every frame
    must be the next in presentation order, or the index was wrong."""
    for frame in frames:
        rank = rank_of.get(frame.pts)
        landed_late = expected is None and rank is not None and rank > keyframe
        if rank is None or landed_late or (expected is not None and rank != expected):
            raise _SeekMismatch
        expected = rank + 1
        if rank >= keyframe and rank in wanted and rank not in found:
            found[rank] = _rgb(frame)
        if rank >= target:
            return
    raise _SeekMismatch  # the stream ended first: let the in-order pass say what is missing


def _decode_seeking(container, stream, wanted: list[int], index: _PacketIndex) -> dict[int, np.ndarray]:
    """Seek to the last safe keyframe before a wanted frame when it lies
    beyond the frames decoded so far; otherwise decode on."""
    rank_of = {pts: rank for rank, pts in enumerate(index.pts)}
    wanted_set, found = set(wanted), {}
    frames, next_rank = None, 0
    for target in wanted:
        keyframe = max((r for r in index.seek_ranks if r <= target), default=None)
        if keyframe is None:
            raise _SeekMismatch
        if frames is None or keyframe > next_rank:
            container.seek(index.pts[keyframe], stream=stream, backward=True, any_frame=False)
            frames = container.decode(stream)
            _decode_from(frames, keyframe, target, None, rank_of, wanted_set, found)
        else:
            _decode_from(frames, 0, target, next_rank, rank_of, wanted_set, found)
        next_rank = target + 1
    return found


def decode_frames(data: bytes, indices: Sequence[int], total_frames: int) -> np.ndarray:
    """Frames `indices` (any order, repeats allowed) of a clip of `total_frames`
    (the header's count) as RGB uint8 [len(indices), H, W, 3].

    VideoDecodeError when the data is corrupt or stops before a wanted frame.
    """
    wanted = sorted(set(int(i) for i in indices))
    if not wanted:
        raise ValueError("no frame indices given")
    if wanted[0] < 0 or wanted[-1] >= total_frames:
        raise ValueError(f"frame indices must lie in [0, {total_frames}), got {wanted[0]}..{wanted[-1]}")
    try:
        found = None
        with _open(data) as container:
            stream = _video_stream(container)
            seekable = container.format.name in SEEKABLE_CONTAINERS and len(wanted) < total_frames
            index = _packet_index(container, stream, total_frames) if seekable else None
            if index is not None:
                stream.thread_type = "AUTO"
                try:
                    found = _decode_seeking(container, stream, wanted, index)
                except _SeekMismatch:
                    found = None
        if found is None:
            found = _decode_in_order(data, wanted)
    except av.FFmpegError as exc:
        raise VideoDecodeError(f"corrupt video data: {exc.strerror or exc}") from None
    missing = [i for i in wanted if i not in found]
    if missing:
        raise VideoDecodeError(f"video is truncated or corrupt: frame {missing[0]} of the {total_frames} "
                               f"its header states could not be decoded ({len(found)} of {len(wanted)} wanted)")
    shapes = {found[i].shape for i in wanted}
    if len(shapes) != 1:
        raise VideoDecodeError(f"frame size changes within the video: {sorted(shapes)}")
    return np.stack([found[int(i)] for i in indices])
