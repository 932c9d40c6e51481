"""Shared fixtures: the tiny built-in checkpoint and checkpoints written by the
reference implementation's own `save_pretrained`."""

from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

REPO = Path(__file__).resolve().parent.parent

# The tokenizer folder and its fixtures, for the tokenizer and chat-template tests.
pytest_plugins = ("tokenizer_cases",)

# Shapes of the checkpoints the reference writes, chosen to differ from the
# tiny one and from each other: GQA ratio, window size, depth, widths, tying.
# The language model's init scale is large so greedy argmax is never a
# near-tie; the vision tower's is moderate so its outputs stay in the range a
# trained tower gives (float32 rounding grows with magnitude).
REFERENCE_SHAPES = {
    "gqa4-tied-window4": dict(
        text=dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=8, num_key_value_heads=2, mrope_section=[2, 3, 3]),
        vision=dict(depth=3, hidden_size=64, intermediate_size=96, num_heads=4,
                    window_size=112, fullatt_block_indexes=[2]),
        tie=True, init=0.25, vision_init=0.08),
    "mha-window1-deep": dict(
        text=dict(hidden_size=96, intermediate_size=160, num_hidden_layers=4,
                  num_attention_heads=3, num_key_value_heads=3, mrope_section=[4, 6, 6]),
        vision=dict(depth=5, hidden_size=48, intermediate_size=80, num_heads=3,
                    window_size=28, fullatt_block_indexes=[0, 4]),
        tie=False, init=0.3, vision_init=0.1),
}


# Every process this run starts inherits the mark, so that the leak check can
# tell this run's segments from those of another run on the same machine.
RUN_MARK = f"EPD_TEST_RUN={os.getpid()}-{os.urandom(4).hex()}"
os.environ["EPD_TEST_RUN"] = RUN_MARK.partition("=")[2]


def ours_or_orphaned(segment: str) -> bool:
    """A segment this run may have left: its creator is gone (or is this
    process), or is alive and carries this run's mark. One whose creator is
    a live process of another run is that run's to clean up."""
    from pipeline.arena.shm import pid_alive

    pid = int(segment.rsplit("-", 2)[-2])
    if pid == os.getpid() or not pid_alive(pid):
        return True
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return True
    return RUN_MARK.encode() in environ


@pytest.fixture(scope="session", autouse=True)
def no_shared_memory_leftovers():
    """The whole suite leaves nothing in /dev/shm."""
    from pipeline.arena.shm import our_segments

    before = set(our_segments())
    yield
    deadline = time.monotonic() + 5.0
    while True:  # a concurrent run's dead stage: its launcher removes the segment soon
        leaked = sorted(s for s in set(our_segments()) - before if ours_or_orphaned(s))
        if not leaked or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not leaked, f"shared-memory segments left behind: {leaked}"


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    from pipeline.models.tiny import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny"))


def write_reference_checkpoint(out_dir: Path, shape: dict) -> Path:
    """A random Qwen2.5-VL checkpoint written by transformers itself, with our
    tiny tokenizer and a preprocessor config beside it."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    from pipeline.models.tiny import preprocessor_config
    from pipeline.models.tiny_tokenizer import write_tiny_tokenizer

    special = write_tiny_tokenizer(out_dir)
    text = dict(shape["text"])
    section = text.pop("mrope_section")
    config = Qwen2_5_VLConfig(
        text_config=dict(
            text, vocab_size=special["vocab_size"], max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "mrope_section": section, "rope_theta": 10000.0},
            initializer_range=shape["init"], bos_token_id=special["<|endoftext|>"],
            eos_token_id=special["<|im_end|>"], tie_word_embeddings=shape["tie"]),
        vision_config=dict(shape["vision"], out_hidden_size=text["hidden_size"], patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2,
                           initializer_range=shape["vision_init"]),
        image_token_id=special["<|image_pad|>"], video_token_id=special["<|video_pad|>"],
        vision_start_token_id=special["<|vision_start|>"],
        vision_end_token_id=special["<|vision_end|>"], tie_word_embeddings=shape["tie"])
    torch.manual_seed(1234)
    model = Qwen2_5_VLForConditionalGeneration(config)
    model.save_pretrained(out_dir)
    (out_dir / "preprocessor_config.json").write_text(json.dumps(preprocessor_config()))
    return out_dir


@pytest.fixture(scope="session")
def reference_dirs(tmp_path_factory) -> dict[str, Path]:
    pytest.importorskip("transformers")
    return {name: write_reference_checkpoint(tmp_path_factory.mktemp(name), shape)
            for name, shape in REFERENCE_SHAPES.items()}


def random_image(height: int, width: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    rng = np.random.default_rng(seed)
    # Smooth noise: closer to a photo than white noise, so resampling matters.
    small = rng.integers(0, 256, size=(max(1, height // 8), max(1, width // 8), 3), dtype=np.uint8)
    image = Image.fromarray(small).resize((width, height), Image.BILINEAR)
    return image.convert(mode)


def image_bytes(image: Image.Image, fmt: str = "PNG") -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    return buf.getvalue()


MAX_TEST_WORKERS = 4


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto` (pyproject's addopts): a worker per core this run may use,
    cgroup quotas counted (CI's 2 cores; a container's --cpus, which
    os.cpu_count() misses). Each worker starts whole stacks of real
    processes, each with torch loaded, so more workers than cores only make
    them wait for one another; the cap bounds their memory on a big box,
    where more than 2 workers were never tried. Measured on the 2-core
    machine: the suite in 19 min with 2 workers against 29 min serially."""
    from pipeline.cpu_threads import usable_cpus

    return max(1, min(usable_cpus(), MAX_TEST_WORKERS))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test that used a running stack shows the stages' log tail:
    on CI that is the only record of what the processes saw."""
    report = yield
    if report.failed and call.when == "call":
        for name, value in getattr(item, "funcargs", {}).items():
            if hasattr(value, "logs") and hasattr(value, "run_dir"):
                report.sections.append((f"stage logs of {name} (tail)", value.logs()))
    return report
