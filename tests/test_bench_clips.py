"""epd-bench's video buckets: (H, W, T) with T > 1 sends a generated clip of
T frames as a video_url part; every clip's bytes are unique (a trailing MP4
`free` box) and still a valid clip of that size and length, except reused
ones, which repeat an earlier clip byte for byte."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from pipeline.bench.clips import CLIP_FPS, MP4_URL_PREFIX, GeneratedClip
from pipeline.bench.dataset import RandomMMConfig, parse_bucket_config, sample_requests
from pipeline.media.video_probe import probe_video


def config(**overrides) -> RandomMMConfig:
    values = dict(num_prompts=6, input_len=4, output_len=2, range_ratio=0.0, base_items=2, items_range_ratio=0.0,
                  buckets=parse_bucket_config("{(48, 64, 10): 0.5, (32, 32, 1): 0.5}"), image_reuse=0.0)
    return RandomMMConfig(**{**values, **overrides})


def clip_bytes(part: dict) -> bytes:
    url = part["video_url"]["url"]
    assert url.startswith(MP4_URL_PREFIX)
    return base64.b64decode(url[len(MP4_URL_PREFIX):])


def test_video_buckets_send_unique_valid_clips():
    requests = sample_requests(config(), np.random.default_rng(1))
    parts = [p for r in requests for p in r.content_parts()]
    videos = [clip_bytes(p) for p in parts if p["type"] == "video_url"]
    assert videos and any(p["type"] == "image_url" for p in parts)
    assert len(set(videos)) == len(videos)   # each a distinct cache key
    header = probe_video(videos[0])
    assert (header.width, header.height, header.total_frames) == (64, 48, 10)
    assert header.fps == pytest.approx(CLIP_FPS)


def test_reused_clips_repeat_byte_for_byte():
    requests = sample_requests(config(image_reuse=1.0, num_prompts=10), np.random.default_rng(2))
    videos = [clip_bytes(p) for r in requests for p in r.content_parts() if p["type"] == "video_url"]
    assert len(set(videos)) < len(videos)
    assert all(isinstance(i, GeneratedClip) or i.height == 32 for r in requests for i in r.images)


def test_a_bucket_key_must_be_three_positive_ints():
    with pytest.raises(ValueError, match=r"\(H, W, T\)"):
        parse_bucket_config("{(48, 64, 0): 1.0}")
