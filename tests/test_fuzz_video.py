"""Property-based tests of what reads untrusted video bytes: probe_video (the
header the proxy counts a clip's placeholders from), plan_video_bytes (the
proxy's plan) and decode_video (the encoders' probe, plan, frame decode and
preprocess), all in pipeline/media/.

Inputs are small clips written with PyAV (tests/video_clips.py) in every
allowed container, then truncated, byte-flipped, cut and spliced, their
header integers (sizes, counts, rates) set to edge values, or replaced by
random bytes. Each reader gives a well-formed result or raises
VideoDecodeError; never another exception, and never a hang (each call has a
time bound: FFmpeg's demuxers and decoders loop in C).
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fuzz_helpers import bounded, fuzz, mutated
from pipeline.media.video_cpu import decode_video, plan_video_bytes
from pipeline.media.video_probe import (
    ALLOWED_CODECS,
    ALLOWED_CONTAINERS,
    ProbeLimits,
    VideoDecodeError,
    VideoHeader,
    probe_video,
)
from pipeline.processing.video_config import INTERVAL_VIDEO_DEFAULTS, TIMESTAMP_VIDEO_DEFAULTS
from video_clips import write_clip, write_empty_clip

TIME_BOUND_S = 20.0
LIMITS = ProbeLimits()
SMALL_LIMITS = ProbeLimits(max_frame_pixels=48 * 48, max_total_frames=64)   # edits of sizes hit them
CONFIGS = (INTERVAL_VIDEO_DEFAULTS, TIMESTAMP_VIDEO_DEFAULTS)
DECODE_CONFIG = TIMESTAMP_VIDEO_DEFAULTS   # samples 4 of a seed's 6 frames: the decoder seeks


def seed_clips() -> dict[str, bytes]:
    """Valid 6-frame 32x32 clips of every allowed container."""
    clips = {
        "mp4-h264": dict(codec="libx264"),
        "mp4-h264-faststart": dict(codec="libx264", faststart=True),
        "mp4-mpeg4-gop2": dict(codec="mpeg4", gop=2),
        "matroska-h264": dict(codec="libx264", container="matroska"),
        "webm-vp9": dict(codec="libvpx-vp9", container="webm"),
        "webm-vp8": dict(codec="libvpx", container="webm"),
        "mpegts-h264": dict(codec="libx264", container="mpegts"),
        "mpegts-mpeg2": dict(codec="mpeg2video", container="mpegts"),
        "avi-mpeg4": dict(codec="mpeg4", container="avi"),
    }
    return {name: write_clip(6, 10, 32, 32, seed=i, **kw).data for i, (name, kw) in enumerate(clips.items())}


SEEDS = seed_clips()

# Where the sizes, counts and rates are: mp4 boxes, Matroska's EBML ids for
# the track entry, video, width/height and duration, AVI's headers, MPEG-TS's
# PES start and an MPEG sequence header, H.264 SPS start codes.
_MARKERS = (b"mvhd", b"tkhd", b"mdhd", b"stsd", b"avc1", b"avcC", b"mp4v", b"esds", b"stts", b"stsz", b"stsc",
            b"stco", b"stss", b"ctts", b"\xae", b"\xe0", b"\xb0", b"\xba", b"\x44\x89", b"\x23\xe3\x83",
            b"avih", b"strh", b"strf", b"idx1", b"\x00\x00\x01\xe0", b"\x00\x00\x01\xb3", b"\x00\x00\x00\x01\x67")


@st.composite
def header_edits(draw, data: bytes) -> bytes:
    """An integer just past one of the header markers set to an edge value."""
    found = [i for marker in _MARKERS for i in _all(data, marker)]
    if not found:
        return data
    buf = bytearray(data)
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.sampled_from(found)) + draw(st.integers(0, 40))
        width = draw(st.sampled_from((1, 2, 4)))
        value = draw(st.sampled_from((0, 1, 0x7F, 0xFF, 0x7FFF, 0xFFFF, 0x7FFFFFFF, 0xFFFFFFFF))
                     | st.integers(0, 2**32 - 1)) % (1 << (8 * width))
        buf[at:at + width] = value.to_bytes(width, "big")
    return bytes(buf[:len(data)])


def _all(data: bytes, marker: bytes, most: int = 8) -> list[int]:
    found, at = [], data.find(marker)
    while at >= 0 and len(found) < most:
        found.append(at + len(marker))
        at = data.find(marker, at + 1)
    return found


@st.composite
def spliced(draw) -> bytes:
    """The head of one clip followed by the tail of another."""
    a, b = draw(st.sampled_from(sorted(SEEDS))), draw(st.sampled_from(sorted(SEEDS)))
    return SEEDS[a][:draw(st.integers(0, len(SEEDS[a])))] + SEEDS[b][draw(st.integers(0, len(SEEDS[b]))):]


any_seed = st.sampled_from(sorted(SEEDS))
clips = st.one_of(
    any_seed.flatmap(lambda name: mutated(SEEDS[name], header=256)),
    any_seed.flatmap(lambda name: header_edits(SEEDS[name])),
    any_seed.flatmap(lambda name: st.integers(0, len(SEEDS[name])).map(lambda n: SEEDS[name][:n])),
    spliced(),
)


# ---------------------------------------------------------------- what a result must look like

def check_probe(data: bytes, limits: ProbeLimits) -> VideoHeader | None:
    try:
        header = bounded(lambda: probe_video(data, limits), TIME_BOUND_S)
    except VideoDecodeError:
        return None
    assert header.container in ALLOWED_CONTAINERS and header.codec in ALLOWED_CODECS
    assert header.width >= 1 and header.height >= 1 and header.width * header.height <= limits.max_frame_pixels
    assert 1 <= header.total_frames <= limits.max_total_frames
    assert math.isfinite(header.fps) and header.fps > 0, header
    assert math.isfinite(header.duration) and header.duration > 0, header
    assert header.stream_duration is None or math.isfinite(header.stream_duration)
    return header


def check_readers(data: bytes, limits: ProbeLimits = LIMITS) -> None:
    """The proxy's path (probe, plan) and the encoder's (decode_video) on the
    same bytes: results consistent with each other, or VideoDecodeError."""
    header = check_probe(data, limits)
    for cfg in CONFIGS:
        try:
            planned, plan = bounded(lambda: plan_video_bytes(data, cfg, limits=limits), TIME_BOUND_S)
        except VideoDecodeError:
            continue
        assert planned == header
        assert plan.frame_indices and all(0 <= i < header.total_frames for i in plan.frame_indices)
        assert plan.num_tokens >= 1
    if header is None:
        return
    try:
        decoded = bounded(lambda: decode_video(data, DECODE_CONFIG, limits=limits), TIME_BOUND_S)
    except VideoDecodeError:
        return
    # The placeholders the proxy counted are the rows the encoder made.
    t, gh, gw = decoded.plan.grid
    assert decoded.header == header
    assert decoded.pixel_values.shape == (t * gh * gw, DECODE_CONFIG.patch_dim)
    assert torch.isfinite(decoded.pixel_values).all()


# ---------------------------------------------------------------- the properties

@pytest.mark.parametrize("name", sorted(SEEDS))
def test_the_seed_clips_probe_and_decode(name):
    header = check_probe(SEEDS[name], LIMITS)
    assert header is not None and header.total_frames == 6 and (header.width, header.height) == (32, 32)
    check_readers(SEEDS[name])


def _with_byte(data: bytes, at: int, value: int) -> bytes:
    return data[:at] + bytes([value]) + data[at + 1:]


@pytest.mark.parametrize("where", ["major brand", "handler name"])
def test_a_metadata_tag_that_is_not_utf8_is_no_error(where):
    """Found by the fuzzer: PyAV decoded container and stream tags strictly,
    so one stray byte in the ftyp brand or the track's handler name raised
    UnicodeDecodeError out of the probe (a 500 at the proxy, not a 400)."""
    data = SEEDS["mp4-h264"]
    at = 8 if where == "major brand" else data.find(b"VideoHandler")
    header = check_probe(_with_byte(data, at, 0x80), LIMITS)
    assert header is not None and header.total_frames == 6
    check_readers(_with_byte(data, at, 0xFF))


def test_a_stream_without_a_codec_is_refused():
    """Found by the fuzzer: an mp4 whose sample description box (stsd) is
    unreadable has a video stream with no codec context, and the probe
    raised AttributeError on it."""
    data = SEEDS["mp4-h264"]
    at = data.find(b"stsd")
    with pytest.raises(VideoDecodeError, match="codec is unknown"):
        probe_video(_with_byte(data, at, ord("r")))
    check_readers(_with_byte(data, at, ord("r")))


def test_a_clip_without_frames_is_refused():
    with pytest.raises(VideoDecodeError):
        probe_video(write_empty_clip())


@fuzz(120)
@given(data=clips)
def test_mutated_clips_read_or_fail_cleanly(data):
    check_readers(data)


@fuzz(60)
@given(data=clips)
def test_mutated_clips_stay_within_the_probe_limits(data):
    check_probe(data, SMALL_LIMITS)


@fuzz(60)
@given(data=st.binary(max_size=512)
       | st.sampled_from([b"\x1a\x45\xdf\xa3", b"\x00\x00\x00\x18ftypisom", b"RIFF\x00\x00\x00\x00AVI LIST",
                          b"\x47\x40\x00\x10"]).flatmap(lambda magic: st.binary(max_size=512).map(magic.__add__)))
def test_random_bytes_fail_cleanly(data):
    check_readers(data)
