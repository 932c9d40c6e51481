"""Video through the served stack (proxy, encoder, generator processes, in
EPD and aggregated mode) with the openai SDK and a data: URL, on tiny
checkpoints of both families:
answers equal bin/epd-generate --video (which equals transformers,
test_video_generate.py), alone, beside an image, streamed and not; a repeated
clip is encoded once; bad video is a 400 naming it and harms no other
request."""

from __future__ import annotations

import base64
import json
import subprocess
import sys

import openai
import pytest

from conftest import REPO, image_bytes, random_image
from e2e_helpers import client, data_url, serving
from stack import Stack
from waiting import until
from video_clips import write_clip

pytest.importorskip("transformers")
import qwen3_vl_helpers as helpers  # noqa: E402

MAX_TOKENS = 8
TEXT = "What happens in this clip?"


@pytest.fixture(scope="module")
def clip():
    return write_clip(12, 4, 64, 48, seed=3).data


@pytest.fixture(scope="module", params=["interval-epd", "interval-aggregated", "timestamp-epd",
                                        "timestamp-aggregated"])
def served(request, tiny_dir, tmp_path_factory):
    variant, mode = request.param.split("-")
    folder = tiny_dir if variant == "interval" else helpers.write_serving_checkpoint(
        tmp_path_factory.mktemp("q3v-serving"))
    layout = dict(encoders=0, generators=1, aggregated=True) if mode == "aggregated" else dict(
        encoders=1, generators=1)
    for stack in serving(Stack(tmp_path_factory.mktemp(f"video-{request.param}"), folder, **layout)):
        yield folder, stack


def video_url(data: bytes) -> str:
    return f"data:video/mp4;base64,{base64.b64encode(data).decode()}"


def ask(stack, video: bytes | None, image: bytes | None = None, stream: bool = False, **extra) -> str:
    parts = [{"type": "image_url", "image_url": {"url": data_url(image)}}] if image else []
    parts += [{"type": "video_url", "video_url": {"url": video_url(video)}}] if video is not None else []
    messages = [{"role": "user", "content": parts + [{"type": "text", "text": TEXT}]}]
    kwargs = dict(model="tiny", messages=messages, max_tokens=MAX_TOKENS, temperature=0,
                  extra_body={"ignore_eos": True, **extra})
    if not stream:
        return client(stack).chat.completions.create(**kwargs).choices[0].message.content
    chunks = client(stack).chat.completions.create(**kwargs, stream=True)
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def epd_generate(folder, tmp_path, video: bytes, image: bytes | None = None) -> str:
    (tmp_path / "clip.mp4").write_bytes(video)
    args = ["--video", str(tmp_path / "clip.mp4")]
    if image is not None:
        (tmp_path / "image.png").write_bytes(image)
        args += ["--image", str(tmp_path / "image.png")]
    run = subprocess.run([sys.executable, str(REPO / "bin" / "epd-generate"), "--model", str(folder),
                          "--prompt", TEXT, *args, "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--json"],
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.splitlines()[-1])["text"]


@pytest.mark.parametrize("with_image", [False, True], ids=["video", "image-and-video"])
def test_a_served_video_answers_as_epd_generate(served, clip, tmp_path, with_image):
    folder, stack = served
    image = image_bytes(random_image(40, 56, seed=8)) if with_image else None
    expected = epd_generate(folder, tmp_path, clip, image)
    for stream in (False, True):
        assert ask(stack, clip, image, stream=stream) == expected


def test_bad_video_is_a_400_naming_it_and_harms_no_other_request(served, clip):
    _, stack = served
    for data, message in ((b"not a video", "video 1: "), (image_bytes(random_image(30, 30, seed=1)), "video 1: ")):
        with pytest.raises(openai.BadRequestError) as caught:
            ask(stack, data)
        assert message in str(caught.value)
    with pytest.raises(openai.BadRequestError, match="mm_processor_kwargs"):
        ask(stack, clip, mm_processor_kwargs={"fps": -1})
    assert ask(stack, clip)   # the stack still answers


def test_a_repeated_clip_is_encoded_once(served):
    folder, stack = served
    if not stack.encoder_instances:
        pytest.skip("aggregated mode has no encoder to count")
    clip = write_clip(10, 5, 48, 32, seed=77).data
    encoded = lambda: stack.total("epd_encoder_jobs_total", outcome="encoded")  # noqa: E731
    settled = wait_for_metrics_to_settle(encoded)
    first = ask(stack, clip)
    assert ask(stack, clip, stream=True) == first
    # One new clip, asked twice: its second request is served from the arena.
    until(lambda: encoded() - settled >= 1, "the clip's encode to be counted (stats are polled)", 10.0)
    assert encoded() - settled == 1
    # Other sampling settings are another embedding.
    ask(stack, clip, mm_processor_kwargs={"num_frames": 4})
    until(lambda: encoded() - settled >= 2, "the other settings' encode to be counted", 10.0)


def wait_for_metrics_to_settle(read, quiet_s: float = 1.2) -> float:
    """The value once it stopped moving for `quiet_s` (earlier tests' encodes counted)."""
    import time

    value, since = read(), time.monotonic()
    while time.monotonic() - since < quiet_s:
        time.sleep(0.1)
        now = read()
        if now != value:
            value, since = now, time.monotonic()
    return value


def test_epd_bench_video_buckets_run_against_the_stack(served, tmp_path):
    # The common bench client's (H, W, T) buckets with T > 1: generated clips.
    _, stack = served
    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, str(REPO / "bin" / "epd-bench"), "--base-url", stack.base_url,
                          "--num-prompts", "3", "--request-rate", "inf", "--random-input-len", "6",
                          "--random-output-len", "4", "--random-mm-base-items-per-request", "1",
                          "--random-mm-bucket-config", "{(48, 64, 8): 1.0}", "--no-progress", "--json", str(out)],
                         capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr
    result = json.loads(out.read_text())
    assert result["completed"] == 3 and result["failed"] == 0, result["errors"]
