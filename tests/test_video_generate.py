"""Video through bin/epd-generate on tiny random checkpoints of both families,
token for token against transformers: its processor (chat template, video
processor sampling the clip itself from the reference reader's frames and
metadata) and its model's greedy generate. A video alone and a video with an
image; a bad video is one line on stderr and exit 1."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from conftest import REPO, image_bytes, random_image
from pipeline.models.loader import load_model
from video_clips import write_clip

pytest.importorskip("transformers")
import qwen3_vl_helpers as helpers  # noqa: E402
import video_reference as ref  # noqa: E402

ref.require_torchvision()
MAX_TOKENS = 8
TEXT = "What happens in this clip?"


@pytest.fixture(scope="module")
def folders(tiny_dir, tmp_path_factory):
    return {"interval": tiny_dir, "timestamp": helpers.write_serving_checkpoint(tmp_path_factory.mktemp("q3v"))}


@pytest.fixture(scope="module")
def clip():
    return write_clip(12, 4, 64, 48, seed=3).data   # 3 s at 4 fps


def epd_generate(folder, tmp_path, video: bytes, image: bytes | None = None):
    (tmp_path / "clip.mp4").write_bytes(video)
    args = ["--video", str(tmp_path / "clip.mp4")]
    if image is not None:
        (tmp_path / "image.png").write_bytes(image)
        args += ["--image", str(tmp_path / "image.png")]
    return subprocess.run([sys.executable, str(REPO / "bin" / "epd-generate"), "--model", str(folder),
                           "--prompt", TEXT, *args, "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--json"],
                          capture_output=True, text=True, timeout=180)


def reference_generate(variant: str, folder, video: bytes, image: bytes | None):
    """(prompt ids, greedy tokens) of transformers' processor and model."""
    import io

    from PIL import Image
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    if variant == "interval":
        from transformers import Qwen2VLVideoProcessor
        processor = ref.interval_prompt_processor(folder, Qwen2VLVideoProcessor.from_pretrained(folder))
    else:
        from transformers import Qwen3VLVideoProcessor
        processor = ref.timestamp_prompt_processor(folder, Qwen3VLVideoProcessor.from_pretrained(folder))
        processor.image_processor = helpers.reference_processor(folder).image_processor
    content = ([{"type": "image"}] if image else []) + [{"type": "video"}, {"type": "text", "text": TEXT}]
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    metadata = ref.reference_metadata(video)
    frames = ref.reference_frames(video, range(metadata.total_num_frames))
    kwargs = dict(images=[Image.open(io.BytesIO(image)).convert("RGB")]) if image else {}
    inputs = processor(text=[text], videos=[frames], video_metadata=[dict(metadata)], return_metadata=True,
                       return_tensors="pt", **kwargs)
    inputs.pop("video_metadata", None)
    model = AutoModelForImageTextToText.from_pretrained(folder, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False)
    ids = inputs["input_ids"][0].tolist()
    return ids, out[0, len(ids):].tolist()


@pytest.mark.parametrize("with_image", [False, True], ids=["video", "image-and-video"])
@pytest.mark.parametrize("variant", ["interval", "timestamp"])
def test_epd_generate_video_equals_the_reference(folders, clip, tmp_path, variant, with_image):
    image = image_bytes(random_image(40, 56, seed=8)) if with_image else None
    run = epd_generate(folders[variant], tmp_path, clip, image)
    assert run.returncode == 0, run.stderr
    ours = json.loads(run.stdout.splitlines()[-1])
    prompt_ids, tokens = reference_generate(variant, folders[variant], clip, image)
    assert ours["prompt_token_ids"] == prompt_ids
    assert ours["token_ids"] == tokens
    # The clip really took part: its temporal patches' placeholders are in the prompt.
    spec = load_model(folders[variant]).model.spec
    runs = sum(1 for a, b in zip(prompt_ids, prompt_ids[1:]) if b == spec.video_token_id != a)
    assert prompt_ids.count(spec.video_token_id) >= 3 * 4 and runs == (3 if variant == "timestamp" else 1)


@pytest.mark.parametrize("data, message", [(b"not a video at all", "video 1: "),
                                           (image_bytes(random_image(30, 30, seed=1)), "video 1: ")])
def test_a_bad_video_is_one_line_and_exit_1(folders, tmp_path, data, message):
    run = epd_generate(folders["interval"], tmp_path, data)
    assert run.returncode == 1
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"epd-generate: error: {message}"), run.stderr
