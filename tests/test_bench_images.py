"""epd-bench's workload images: unique bytes per image from a few encoded
noise pictures (a JPEG comment carries the nonce), byte-identical reuse."""

from __future__ import annotations

import base64
import io

import numpy as np
from PIL import Image

from bench_fakes import small_dataset
from pipeline.bench import dataset as bench_dataset
from pipeline.bench.dataset import PIXEL_POOL_SIZE, POOL_SIZE_PER_BUCKET, parse_bucket_config, sample_requests


def jpeg_bytes(url: str) -> bytes:
    return base64.b64decode(url.split(",", 1)[1])


def without_comment(jpeg: bytes) -> bytes:
    """The JPEG with the comment segment after SOI taken out."""
    assert jpeg[:4] == b"\xff\xd8\xff\xfe"
    length = int.from_bytes(jpeg[4:6], "big")
    return jpeg[:2] + jpeg[4 + length:]


def test_images_are_distinct_bytes_over_a_few_encoded_pictures(monkeypatch):
    encodes = []
    encode = bench_dataset._encode_noise_jpeg
    monkeypatch.setattr(bench_dataset, "_encode_noise_jpeg", lambda *key: encodes.append(key) or encode(*key))
    bench_dataset.pooled_jpeg_tail.cache_clear()
    try:
        buckets = parse_bucket_config("{(24, 40, 1): 1, (16, 16, 1): 1}")
        cfg = small_dataset(num_prompts=40, base_items=2, buckets=buckets)
        requests = sample_requests(cfg, np.random.default_rng(5))
        images = [(image, jpeg_bytes(url)) for r in requests for image, url in zip(r.images, r.image_urls)]
        assert len(images) == 80 and len({data for _, data in images}) == 80
        for image, data in images:
            decoded = Image.open(io.BytesIO(data))
            assert decoded.format == "JPEG" and decoded.size == (image.width, image.height)
        assert {(image.height, image.width) for image, _ in images} == {(24, 40), (16, 16)}
        # Pixels come from at most PIXEL_POOL_SIZE encodes per bucket.
        assert len(encodes) <= 2 * PIXEL_POOL_SIZE
        assert len({without_comment(data) for _, data in images}) == len(encodes)
    finally:
        bench_dataset.pooled_jpeg_tail.cache_clear()
    # The same seed sends the same bytes; another seed (another run) none of them.
    again = [u for r in sample_requests(cfg, np.random.default_rng(5)) for u in r.image_urls]
    other = {u for r in sample_requests(cfg, np.random.default_rng(6)) for u in r.image_urls}
    assert [jpeg_bytes(u) for u in again] == [data for _, data in images] and not other & set(again)


def test_reused_images_repeat_earlier_bytes():
    cfg = small_dataset(num_prompts=100, image_reuse=0.5)
    requests = sample_requests(cfg, np.random.default_rng(2))
    images = [(image, url) for r in requests for image, url in zip(r.images, r.image_urls)]
    reused = [url for image, url in images if " reuse " in image.nonce]
    fresh = [url for image, url in images if " reuse " not in image.nonce]
    assert 20 < len(reused) < 80
    assert len(set(reused)) <= POOL_SIZE_PER_BUCKET and len(set(fresh)) == len(fresh)
    assert not set(reused) & set(fresh)
