"""Media backends (pipeline/media) against the reference transformers Pillow
image processor: Pillow bit for bit, DALI (CPU mode, when installed) within its
documented tolerance; bad media isolated per slot; the backend registry."""

from __future__ import annotations

import io
import logging
import struct
import sys
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import image_bytes, random_image
from pipeline.media import (BackendUnavailableError, DecodedImage, Tolerance, available_backends,
                            create_backend, registry)
from pipeline.media.nvjpeg_backend import RESIZE_TOLERANCE
from pipeline.media.patches import normalize_table, patchify, resize_bicubic
from pipeline.media.pillow_backend import PillowBackend
from pipeline.media.probe import probe
from pipeline.media.routing import decode_routed
from pipeline.processing.image import ImageDecodeError, ImageProcessorConfig, preprocess_images

CFG = ImageProcessorConfig()
# (height, width, mode, format): upscaled, identity, downscaled, alpha, grey.
CASES = [
    (37, 91, "RGB", "JPEG"),
    (91, 37, "RGB", "PNG"),
    (224, 224, "RGB", "JPEG"),
    (640, 640, "RGB", "JPEG"),
    (720, 1280, "RGB", "JPEG"),
    (1500, 2000, "RGB", "JPEG"),
    (333, 517, "RGBA", "PNG"),
    (120, 200, "L", "JPEG"),
]
BACKENDS = ["pillow", "dali"]


def _has_dali() -> bool:
    try:
        import nvidia.dali.experimental.dynamic  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request):
    if request.param == "dali":
        pytest.importorskip("nvidia.dali.experimental.dynamic")
    with create_backend(request.param, "cpu") as made:
        yield made


@pytest.fixture(scope="module")
def reference():
    pytest.importorskip("transformers")
    module = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    return module.Qwen2VLImageProcessorPil()


def case_blob(height: int, width: int, mode: str, fmt: str) -> bytes:
    image = random_image(height, width, seed=height * 31 + width, mode=mode)
    if mode == "RGBA":  # a gradient alpha, so compositing onto white matters
        alpha = np.linspace(0, 255, width, dtype=np.uint8)[None, :].repeat(height, 0)
        image.putalpha(Image.fromarray(alpha))
    return image_bytes(image, fmt)


def reference_output(reference, blob: bytes) -> tuple[np.ndarray, tuple[int, ...]]:
    with Image.open(io.BytesIO(blob)) as image:
        out = reference(images=[image], return_tensors="np")
    return out["pixel_values"], tuple(int(v) for v in out["image_grid_thw"][0])


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_claiming_size(width: int, height: int) -> bytes:
    """Signature + IHDR for an RGB image of that size + an empty IDAT: no pixels at all."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", b"")


def good_blobs() -> list[bytes]:
    return [case_blob(64, 96, "RGB", "JPEG"), case_blob(50, 70, "RGBA", "PNG")]


# ---------------------------------------------------------------- against the reference

def test_outputs_match_reference(backend, reference):
    blobs = [case_blob(*case) for case in CASES]
    results = backend.decode(blobs, CFG)
    assert len(results) == len(blobs)
    exact = backend.name == "pillow"
    for case, blob, result in zip(CASES, blobs, results):
        assert isinstance(result, DecodedImage), (case, result)
        expected, grid = reference_output(reference, blob)
        assert result.grid == grid and result.source_size == case[:2]
        ours = result.pixel_values
        assert ours.dtype == torch.float32 and ours.device == backend.device
        assert tuple(ours.shape) == expected.shape == (grid[1] * grid[2], CFG.patch_dim)
        if exact:
            assert np.array_equal(ours.numpy(), expected), case
        else:
            max_abs, mean_abs = Tolerance.measure(ours, torch.from_numpy(expected))
            assert backend.tolerance.allows(max_abs, mean_abs), (case, max_abs, mean_abs)


def test_pillow_backend_equals_preprocess_images():
    blobs = [case_blob(*case) for case in CASES[:4]]
    with PillowBackend(num_threads=3) as pillow:
        results = pillow.decode(blobs, CFG)
    expected, grids = preprocess_images([Image.open(io.BytesIO(b)) for b in blobs], CFG)
    assert torch.equal(torch.cat([r.pixel_values for r in results]), expected)
    assert [r.grid for r in results] == [tuple(g) for g in grids.tolist()]


def test_pillow_thread_count_does_not_change_outputs():
    blobs = [case_blob(*case) for case in CASES[:5]]
    with PillowBackend(num_threads=1) as serial, PillowBackend(num_threads=4) as pooled:
        for a, b in zip(serial.decode(blobs, CFG), pooled.decode(blobs, CFG)):
            assert torch.equal(a.pixel_values, b.pixel_values) and a.grid == b.grid


@pytest.mark.parametrize("num_threads", [0, 65, 2.0, True])
def test_pillow_rejects_bad_thread_count(num_threads):
    with pytest.raises(ValueError, match="num_threads"):
        PillowBackend(num_threads=num_threads)


# ---------------------------------------------------------------- bad media

def test_bad_media_fails_only_its_own_slot(backend):
    jpeg = case_blob(300, 400, "RGB", "JPEG")
    bad = {
        1: (jpeg[: len(jpeg) // 2], "truncated"),
        2: (b"", "empty"),
        3: (b"this is not an image, just some bytes " * 4, "not a recognised image"),
        4: (png_claiming_size(100_000, 100_000), "too large"),
    }
    good = good_blobs()
    batch = [good[0], *(blob for blob, _ in bad.values()), good[1]]
    results = backend.decode(batch, CFG)
    for i, (_, reason) in bad.items():
        assert isinstance(results[i], ImageDecodeError), (i, results[i])
        assert reason in str(results[i])
    alone = backend.decode(good, CFG)
    for ours, clean in zip((results[0], results[-1]), alone):
        assert isinstance(ours, DecodedImage)
        assert torch.equal(ours.pixel_values, clean.pixel_values)
    # The backend serves the next batch normally.
    again = backend.decode(good, CFG)
    assert all(torch.equal(a.pixel_values, b.pixel_values) for a, b in zip(again, alone))


def test_size_limit_checked_from_header_before_decoding(backend):
    # The PNG has no pixel data: had anything been decoded, the error would say
    # corrupt/truncated; "max_image_pixels" proves the header check fired first.
    cfg = ImageProcessorConfig(max_image_pixels=1_000_000)
    results = backend.decode([png_claiming_size(2000, 1000), good_blobs()[0]], cfg)
    assert isinstance(results[0], ImageDecodeError) and "max_image_pixels" in str(results[0])
    assert isinstance(results[1], DecodedImage)


def test_extreme_aspect_ratio_is_bad_media(backend):
    results = backend.decode([image_bytes(random_image(4, 1000)), good_blobs()[0]], CFG)
    assert isinstance(results[0], ImageDecodeError) and "aspect ratio" in str(results[0])
    assert isinstance(results[1], DecodedImage)


def test_non_bytes_item_is_a_caller_error(backend):
    with pytest.raises(TypeError, match=r"blobs\[1\]"):
        backend.decode([good_blobs()[0], "not bytes"], CFG)
    assert backend.decode([], CFG) == []


# ---------------------------------------------------------------- routing and probing

def test_gpu_decoder_failure_is_isolated_then_left_to_pillow():
    """A GPU decoder that fails a batch is retried per image; the image it still
    fails on is decoded by Pillow (valid) and the others keep their GPU result."""
    blobs = [case_blob(40, 60, "RGB", "JPEG"), case_blob(50, 80, "RGB", "JPEG"),
             case_blob(30, 30, "RGB", "PNG")]
    calls = []

    def flaky_gpu(batch):
        calls.append(len(batch))
        if blobs[1] in batch:
            raise RuntimeError("nvjpeg: unsupported stream")
        return ["gpu"] * len(batch)

    headers = {i: probe(b, CFG) for i, b in enumerate(blobs)}
    slots: list = [None] * 3
    images = decode_routed(blobs, headers, slots, CFG, gpu_decode=flaky_gpu,
                           from_pillow=lambda rgb: rgb.shape, label="fake")
    assert calls == [2, 1, 1]  # the batch of JPEGs, then each alone
    assert images == {0: "gpu", 1: (50, 80, 3), 2: (30, 30, 3)}
    assert slots == [None] * 3


def test_probe_routes_only_complete_grey_or_ycbcr_jpegs():
    jpeg = image_bytes(random_image(64, 64), "JPEG")
    assert probe(jpeg, CFG).gpu_jpeg
    assert probe(image_bytes(random_image(64, 64, mode="L"), "JPEG"), CFG).gpu_jpeg
    assert not probe(image_bytes(random_image(64, 64, mode="CMYK"), "JPEG"), CFG).gpu_jpeg
    assert not probe(image_bytes(random_image(64, 64), "PNG"), CFG).gpu_jpeg
    # Cut inside the scan data: no end-of-image marker after the scan start.
    assert not probe(jpeg[: len(jpeg) * 2 // 3], CFG).gpu_jpeg
    # An Adobe APP14 segment saying "transform 0": plain RGB, not YCbCr.
    for transform, expected in ((0, False), (1, True)):
        app14 = b"\xff\xee" + struct.pack(">H", 14) + b"Adobe" + bytes([0, 100, 0, 0, 0, 0, transform])
        assert probe(jpeg[:2] + app14 + jpeg[2:], CFG).gpu_jpeg is expected
    header = probe(jpeg, CFG)
    assert header.source_size == (64, 64) and header.resized == (56, 56) and header.grid == (1, 4, 4)


# ---------------------------------------------------------------- torch steps (GPU backends)

@pytest.mark.parametrize("height,width", [(37, 91), (224, 224), (333, 517)])
def test_patchify_is_exact_for_identical_pixels(height, width):
    # Pillow resizes once; both paths then patchify the very same uint8 pixels.
    header = probe(image_bytes(random_image(height, width)), CFG)
    image = random_image(height, width).resize(header.resized[::-1], Image.BICUBIC)
    expected, _ = preprocess_images([image], CFG)
    rgb = torch.from_numpy(np.array(image))
    assert torch.equal(patchify(rgb, CFG, normalize_table(CFG, torch.device("cpu"))), expected)


@pytest.mark.parametrize("height,width", [(37, 91), (640, 640), (720, 1280), (1500, 2000)])
def test_torch_resize_within_its_tolerance(height, width):
    """The resize the nvJPEG backend runs on the GPU, here on the CPU."""
    image = random_image(height, width, seed=7)
    expected, grid = preprocess_images([image], CFG)
    chw = torch.from_numpy(np.array(image)).permute(2, 0, 1)
    _, gh, gw = grid[0].tolist()
    rgb = resize_bicubic(chw, gh * CFG.patch_size, gw * CFG.patch_size)
    ours = patchify(rgb, CFG, normalize_table(CFG, torch.device("cpu")))
    assert RESIZE_TOLERANCE.allows(*Tolerance.measure(ours, expected))


# ---------------------------------------------------------------- registry

def test_registry_lists_what_can_run_here():
    names = available_backends("cpu")
    assert names[0] == "pillow" and "nvjpeg" not in names
    assert ("dali" in names) == _has_dali()


def test_auto_on_cpu_picks_pillow_and_says_so(caplog):
    with caplog.at_level(logging.INFO, logger="pipeline.media.registry"):
        with create_backend("auto", "cpu") as chosen:
            assert chosen.name == "pillow" and chosen.device == torch.device("cpu")
    assert "auto chose pillow" in caplog.text


def test_options_reach_the_factory():
    with create_backend("auto", "cpu", num_threads=3) as chosen:
        assert chosen.num_threads == 3
    with pytest.raises(ValueError, match="num_threads"):
        create_backend("pillow", "cpu", num_threads=0)


def test_missing_nvjpeg_raises_with_reason():
    with pytest.raises(BackendUnavailableError, match="nvjpeg.*CUDA"):
        create_backend("nvjpeg", "cpu")


def test_missing_dali_raises_with_reason(monkeypatch):
    # A None entry in sys.modules makes the import fail as if DALI were absent.
    monkeypatch.setitem(sys.modules, "nvidia.dali.experimental.dynamic", None)
    with pytest.raises(BackendUnavailableError, match="dali.*pip install nvidia-dali"):
        create_backend("dali", "cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_cuda_without_gpu_names_every_reason():
    with pytest.raises(BackendUnavailableError, match="no media backend.*dali.*nvjpeg.*pillow"):
        create_backend("auto", "cuda")
    with pytest.raises(BackendUnavailableError, match="no CUDA device"):
        create_backend("dali", "cuda")


def test_unknown_and_duplicate_names_are_refused():
    with pytest.raises(ValueError, match="unknown media backend 'bogus'"):
        create_backend("bogus", "cpu")
    with pytest.raises(ValueError, match="already registered"):
        registry.register_backend("pillow", PillowBackend, lambda device: None)
