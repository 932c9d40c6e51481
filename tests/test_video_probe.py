"""The PyAV probe and frame decoder: header metadata equals what the clip was
written with (and what the reference's PyAV reader reads), bad bytes fail with
VideoDecodeError and a clear reason, and decoded frames equal the reference
reader's, whether the decoder seeks or not."""

from __future__ import annotations

import io

import av
import numpy as np
import pytest
from PIL import Image

import video_reference as ref
from pipeline.media import video_probe
from pipeline.media.video_probe import ProbeLimits, VideoDecodeError, decode_frames, probe_video
from video_clips import NTSC, decode_all, write_clip, write_empty_clip

# (frames, fps, width, height, codec, gop): 0.5 s, 3 s and 7 s at 10, 24, 29.97 and 30 fps.
CLIPS = {
    "h264-10fps-0.5s-64x48": (5, 10, 64, 48, "libx264", None),
    "mpeg4-24fps-3s-200x120": (72, 24, 200, 120, "mpeg4", 12),
    "h264-29.97fps-3s-96x64": (90, NTSC, 96, 64, "libx264", None),
    "h264-30fps-7s-64x48-gop12": (210, 30, 64, 48, "libx264", 12),
    "mpeg4-10fps-7s-120x200": (70, 10, 120, 200, "mpeg4", None),
}


@pytest.fixture(scope="module")
def clips():
    return {name: write_clip(n, fps, w, h, codec=codec, gop=gop, seed=i)
            for i, (name, (n, fps, w, h, codec, gop)) in enumerate(CLIPS.items())}


@pytest.mark.parametrize("name", CLIPS)
def test_probe_reads_what_the_clip_was_written_with(clips, name):
    clip = clips[name]
    header = probe_video(clip.data)
    assert (header.width, header.height, header.codec) == (clip.width, clip.height, clip.codec)
    assert header.total_frames == clip.frames and not header.frames_counted
    assert header.fps == float(clip.fps)
    assert header.duration == clip.frames / float(clip.fps)
    assert header.stream_duration == pytest.approx(clip.frames / float(clip.fps), abs=1 / float(clip.fps))
    assert header.container == "mov,mp4,m4a,3gp,3g2,mj2"


@pytest.mark.parametrize("name", CLIPS)
def test_probe_equals_the_reference_pyav_reader(clips, name):
    header, reference = probe_video(clips[name].data), ref.reference_metadata(clips[name].data)
    assert (header.total_frames, header.fps, header.duration) == (
        reference.total_num_frames, reference.fps, reference.duration)
    assert (header.height, header.width) == (reference.height, reference.width)


def test_a_header_without_a_frame_count_counts_packets():
    clip = write_clip(12, 24, 64, 48, container="matroska")
    header = probe_video(clip.data)
    assert header.frames_counted and header.total_frames == 12 and header.fps == 24.0
    assert header.container == "matroska,webm"


@pytest.mark.parametrize("name", CLIPS)
def test_decoded_frames_equal_the_reference_reader(clips, name):
    clip = clips[name]
    n = clip.frames
    indices = sorted({0, 1, n // 3, n // 2, n - 2, n - 1})
    ours = decode_frames(clip.data, indices, n)
    assert ours.dtype == np.uint8 and ours.shape == (len(indices), clip.height, clip.width, 3)
    assert np.array_equal(ours, ref.reference_frames(clip.data, indices))


OTHER_CONTAINERS = {"mpeg4-matroska": ("mpeg4", "matroska"), "mpeg4-avi": ("mpeg4", "avi"),
                    "h264-mpegts": ("libx264", "mpegts")}


@pytest.fixture(scope="module")
def other_clips():
    return {name: write_clip(60, 25, 64, 48, codec=codec, container=container, gop=10)
            for name, (codec, container) in OTHER_CONTAINERS.items()}


@pytest.mark.parametrize("name", OTHER_CONTAINERS)
def test_other_containers_decode_the_same_frames(other_clips, name):
    clip = other_clips[name]
    header = probe_video(clip.data)
    assert (header.total_frames, header.fps, header.codec) == (60, 25.0, clip.codec)
    wanted = [0, 7, 14, 30, 31, 59]
    assert np.array_equal(decode_frames(clip.data, wanted, 60), decode_all(clip.data)[wanted])


@pytest.mark.parametrize("name", [*CLIPS, "mpeg4-matroska", "mpeg4-avi"])
def test_seeking_decodes_the_same_frames_as_decoding_in_order(clips, other_clips, name):
    clip = {**clips, **other_clips}[name]
    everything = decode_all(clip.data)
    with video_probe._open(clip.data) as container:
        stream = video_probe._video_stream(container)
        index = video_probe._packet_index(container, stream, clip.frames)
        assert index is not None and index.seek_ranks[0] == 0
        wanted = sorted(set(range(0, clip.frames, 7)) | {clip.frames - 1})
        # The shortcut itself, not its in-order fallback, must produce them.
        found = video_probe._decode_seeking(container, stream, wanted, index)
    assert sorted(found) == wanted
    for i in wanted:
        assert np.array_equal(found[i], everything[i]), f"frame {i}"


def test_seeking_is_taken_where_keyframes_allow_it(clips):
    clip = clips["h264-30fps-7s-64x48-gop12"]
    with video_probe._open(clip.data) as container:
        index = video_probe._packet_index(container, video_probe._video_stream(container), clip.frames)
    assert len(index.seek_ranks) >= clip.frames // 30  # at least one IDR a second to seek to


def test_decode_keeps_the_requested_order_and_repeats(clips):
    clip = clips["h264-29.97fps-3s-96x64"]
    everything = decode_all(clip.data)
    indices = [89, 3, 3, 40, 0]
    assert np.array_equal(decode_frames(clip.data, indices, clip.frames), everything[indices])


def test_decode_refuses_indices_outside_the_clip(clips):
    clip = clips["h264-10fps-0.5s-64x48"]
    with pytest.raises(ValueError, match=r"\[0, 5\)"):
        decode_frames(clip.data, [0, 5], clip.frames)
    with pytest.raises(ValueError, match="no frame indices"):
        decode_frames(clip.data, [], clip.frames)


# ---------------------------------------------------------------- bad input

def _png() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (32, 24), (10, 200, 30)).save(out, format="PNG")
    return out.getvalue()


def _mp4_without_video() -> bytes:
    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        container.start_encoding()
    return out.getvalue()


@pytest.mark.parametrize("make, message", [
    (lambda: np.random.default_rng(0).bytes(4000), "not a readable video"),
    (lambda: write_clip(30, 10, 64, 48).data[:-3000], "not a readable video"),  # index (moov) at the end: gone
    (lambda: b"", "empty video data"),
    (lambda: write_empty_clip(), "no frames"),
    (_mp4_without_video, "no video stream"),
    (_png, "unsupported container 'png_pipe'"),
    (lambda: write_clip(4, 10, 64, 48, codec="ffv1", container="matroska").data, "unsupported video codec 'ffv1'"),
])
def test_bad_bytes_fail_with_a_clear_reason(make, message):
    with pytest.raises(VideoDecodeError, match=message):
        probe_video(make())


def test_a_clip_cut_short_after_its_index_fails_while_decoding():
    clip = write_clip(30, 10, 64, 48, faststart=True)
    cut = clip.data[: len(clip.data) * 2 // 3]
    header = probe_video(cut)  # the header, in front, is intact and promises 30 frames
    assert header.total_frames == 30
    with pytest.raises(VideoDecodeError, match="truncated or corrupt: frame"):
        decode_frames(cut, [0, 29], header.total_frames)


def test_limits_are_checked_from_the_header():
    clip = write_clip(12, 24, 64, 48)
    with pytest.raises(VideoDecodeError, match="frames too large: 64x48"):
        probe_video(clip.data, ProbeLimits(max_frame_pixels=64 * 47))
    with pytest.raises(VideoDecodeError, match="too long: 12 frames"):
        probe_video(clip.data, ProbeLimits(max_total_frames=11))


def test_non_bytes_is_a_caller_bug():
    with pytest.raises(TypeError, match="must be bytes"):
        probe_video("clip.mp4")
