"""DALI's video backend where CI can run it: DALI's CPU decoder (VP8/VP9 in
this DALI; NVDEC is checked on the GPU box by scripts/gpu_video_check.py).
Against the PyAV reference: the same plan and grid, pixel values within the
backend's stated tolerance, clips DALI cannot take decoded by PyAV exactly,
bad clips failing alone with PyAV's message; the registry's video side; and
the served stack with its encoder on DALI."""

from __future__ import annotations

import base64

import pytest
import torch

from pipeline.media.base import BackendUnavailableError, Tolerance
from pipeline.media.registry import create_video_backend, video_backend_names
from pipeline.media.video_backend import PyAVVideoBackend, VideoClip
from pipeline.media.video_probe import ProbeLimits, VideoDecodeError
from pipeline.processing.video import VideoOptions
from pipeline.processing.video_config import INTERVAL_VIDEO_DEFAULTS, TIMESTAMP_VIDEO_DEFAULTS
from video_clips import write_clip

pytest.importorskip("nvidia.dali.experimental.dynamic")
from pipeline.media.dali_video import CPU_TOLERANCE, DaliVideoBackend  # noqa: E402

CONFIGS = {"interval": INTERVAL_VIDEO_DEFAULTS, "timestamp": TIMESTAMP_VIDEO_DEFAULTS}


@pytest.fixture(scope="module")
def backends():
    with PyAVVideoBackend() as reference, DaliVideoBackend("cpu", num_threads=2) as dali:
        yield reference, dali


@pytest.mark.parametrize("variant", list(CONFIGS))
@pytest.mark.parametrize("codec", ["libvpx-vp9", "libvpx"])
@pytest.mark.parametrize("size", [(64, 48, 12, 4), (160, 90, 30, 30)], ids=["64x48@4", "160x90@30"])
def test_dali_frames_match_pyav_within_its_tolerance(backends, variant, codec, size):
    reference, dali = backends
    width, height, frames, fps = size
    clip = VideoClip(write_clip(frames, fps, width, height, codec=codec, container="webm", seed=5).data)
    cfg = CONFIGS[variant]
    fallbacks = dali.fallbacks
    want, got = reference.decode([clip], cfg)[0], dali.decode([clip], cfg)[0]
    assert dali.fallbacks == fallbacks, "DALI should have decoded this clip itself"
    assert got.plan == want.plan and got.pixel_values.shape == want.pixel_values.shape
    max_abs, mean_abs = Tolerance.measure(got.pixel_values, want.pixel_values)
    assert dali.tolerance.allows(max_abs, mean_abs), (max_abs, mean_abs)


def test_a_request_s_sampling_picks_the_same_frames(backends):
    reference, dali = backends
    data = write_clip(40, 10, 64, 48, codec="libvpx-vp9", container="webm", seed=9).data
    for options in (VideoOptions(fps=3.0, num_frames=None), VideoOptions(fps=None, num_frames=6)):
        want, got = (b.decode([VideoClip(data, options)], INTERVAL_VIDEO_DEFAULTS)[0] for b in backends)
        assert got.plan.frame_indices == want.plan.frame_indices and got.plan.grid == want.plan.grid
        assert CPU_TOLERANCE.allows(*Tolerance.measure(got.pixel_values, want.pixel_values))


def test_a_codec_dali_lacks_here_is_decoded_by_pyav_exactly(backends):
    reference, dali = backends
    clip = VideoClip(write_clip(12, 4, 64, 48, seed=2).data)   # H.264: NVDEC only
    assert not dali.takes("h264")
    want, got = reference.decode([clip], INTERVAL_VIDEO_DEFAULTS)[0], dali.decode([clip], INTERVAL_VIDEO_DEFAULTS)[0]
    assert torch.equal(got.pixel_values, want.pixel_values)


def test_bad_clips_fail_alone_with_pyav_s_message(backends):
    reference, dali = backends
    good = write_clip(12, 4, 64, 48, codec="libvpx-vp9", container="webm", seed=4).data
    # WebM states no frame count: a cut clip is probed, planned and decoded as a shorter one.
    cut = good[: len(good) * 2 // 3]
    clips = [VideoClip(b"not a video"), VideoClip(cut), VideoClip(good), VideoClip(b""),
             VideoClip(write_clip(30, 4, 64, 48, codec="libvpx-vp9", container="webm").data)]
    limits = ProbeLimits(max_total_frames=20)   # the last clip is over it
    got = dali.decode(clips, INTERVAL_VIDEO_DEFAULTS, limits)
    want = reference.decode(clips, INTERVAL_VIDEO_DEFAULTS, limits)
    assert [type(r).__name__ for r in got] == ["VideoDecodeError", "DecodedVideo", "DecodedVideo",
                                               "VideoDecodeError", "VideoDecodeError"]
    for ours, theirs in zip(got, want):
        assert type(ours) is type(theirs)
        if isinstance(theirs, VideoDecodeError):
            assert str(ours) == str(theirs)
        else:
            assert ours.plan == theirs.plan
            assert CPU_TOLERANCE.allows(*Tolerance.measure(ours.pixel_values, theirs.pixel_values))


class FailsOnMarkedClips(DaliVideoBackend):
    """DALI's CPU decoder, failing every call that holds a marked clip (as
    DALI does on a clip its demuxer or decoder rejects)."""

    marked: set[bytes] = set()

    def _run_decoder(self, blobs, plans):
        if self.marked & set(blobs):
            raise RuntimeError("Unexpected out-of-bounds frame index (injected)")
        return super()._run_decoder(blobs, plans)


def test_a_clip_dali_fails_on_costs_only_itself_a_fallback():
    clips = [write_clip(12, 4, 64, 48, codec="libvpx-vp9", container="webm", seed=s).data for s in (1, 2, 3)]
    with FailsOnMarkedClips("cpu", num_threads=2) as dali, PyAVVideoBackend() as reference:
        dali.marked = {clips[1]}
        got = dali.decode([VideoClip(c) for c in clips], INTERVAL_VIDEO_DEFAULTS)
        want = reference.decode([VideoClip(c) for c in clips], INTERVAL_VIDEO_DEFAULTS)
        assert dali.fallbacks == 1
        assert torch.equal(got[1].pixel_values, want[1].pixel_values)   # PyAV's own
        for i in (0, 2):   # DALI's, retried alone after the batch failed
            max_abs, mean_abs = Tolerance.measure(got[i].pixel_values, want[i].pixel_values)
            assert CPU_TOLERANCE.allows(max_abs, mean_abs) and max_abs > 0


def test_the_registry_s_video_side():
    assert {"pyav", "dali"} <= set(video_backend_names())
    with create_video_backend("auto", "cpu") as auto:
        assert auto.name == "pyav"   # the exact reference on the CPU
    with create_video_backend("dali", "cpu") as named:
        assert named.name == "dali" and named.device == torch.device("cpu")
    with pytest.raises(ValueError, match="unknown video backend 'bogus'"):
        create_video_backend("bogus", "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(BackendUnavailableError, match="no CUDA device"):
            create_video_backend("dali", "cuda")


def test_the_served_stack_with_its_encoder_on_dali(tiny_dir, tmp_path):
    from e2e_helpers import client, serving
    from stack import Stack

    vp9 = write_clip(12, 4, 64, 48, codec="libvpx-vp9", container="webm", seed=6).data
    h264 = write_clip(12, 4, 64, 48, seed=6).data

    def ask(stack, data, mime):
        url = f"data:{mime};base64,{base64.b64encode(data).decode()}"
        messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                                 {"type": "text", "text": "What happens?"}]}]
        reply = client(stack).chat.completions.create(model="tiny", messages=messages, max_tokens=4,
                                                      temperature=0, extra_body={"ignore_eos": True})
        return reply.choices[0].message.content

    answers = {}
    for backend in ("pyav", "dali"):
        (tmp_path / backend).mkdir()
        stack = Stack(tmp_path / backend, tiny_dir, encoders=1, generators=1,
                      encoder_args=("--video-backend", backend))
        for stack in serving(stack):
            answers[backend] = (ask(stack, vp9, "video/webm"), ask(stack, h264, "video/mp4"))
            assert ask(stack, vp9, "video/webm") == answers[backend][0]   # the arena's copy
            assert f"video {backend}" in stack.logs()
    # H.264 goes to PyAV on DALI's CPU side: the same pixels, the same tokens.
    assert answers["dali"][1] == answers["pyav"][1]
    assert answers["dali"][0]
