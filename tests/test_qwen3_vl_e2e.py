"""Qwen3-VL end to end, on a tiny checkpoint written by transformers
(tests/qwen3_vl_helpers.py): bin/epd-generate's greedy tokens equal the
reference's generate on the reference processor's inputs (text only, one
image, two images of different sizes, a tiny image); the served stack
through the openai SDK answers the same, in EPD and aggregated mode,
streamed and not, and under concurrent requests."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import REPO, image_bytes, random_image
from e2e_helpers import chat, serving
from stack import Stack

pytest.importorskip("transformers")
import qwen3_vl_helpers as helpers  # noqa: E402

# (height, width) of each image, in order.
CASES = {"text-only": [], "one-image": [(96, 160)], "two-sizes": [(200, 140), (64, 96)], "tiny-image": [(20, 30)]}
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return helpers.write_serving_checkpoint(tmp_path_factory.mktemp("qwen3-vl-e2e"))


@pytest.fixture(scope="module")
def epd(folder, tmp_path_factory):
    yield from serving(Stack(tmp_path_factory.mktemp("q3epd"), folder, encoders=1, generators=2))


@pytest.fixture(scope="module")
def aggregated(folder, tmp_path_factory):
    yield from serving(Stack(tmp_path_factory.mktemp("q3agg"), folder, encoders=0, generators=1, aggregated=True))


def pictures(sizes) -> list[bytes]:
    return [image_bytes(random_image(h, w, seed=h * 3 + w)) for h, w in sizes]


def text_for(case: str) -> str:
    return f"Tell me about {case}."


def epd_generate(folder, tmp_path, images: list[bytes], text: str) -> dict:
    args = []
    for i, data in enumerate(images):
        path = tmp_path / f"img{i}.png"
        path.write_bytes(data)
        args += ["--image", str(path)]
    run = subprocess.run([sys.executable, str(REPO / "bin" / "epd-generate"), "--model", str(folder),
                          "--prompt", text, *args, "--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--json"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.splitlines()[-1])


def reference_generate(folder, images: list[bytes], text: str) -> tuple[list[int], list[int]]:
    """(prompt ids, greedy tokens) of transformers' processor and model."""
    import io

    from PIL import Image
    from transformers import Qwen3VLForConditionalGeneration

    processor = helpers.reference_processor(folder)
    messages = [{"role": "user", "content": [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    inputs = processor(text=[prompt], images=pil or None, return_tensors="pt")
    model = Qwen3VLForConditionalGeneration.from_pretrained(folder, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False)
    ids = inputs["input_ids"][0].tolist()
    return ids, out[0, len(ids):].tolist()


@pytest.mark.parametrize("case", sorted(CASES))
def test_epd_generate_equals_the_reference(folder, tmp_path, case):
    images = pictures(CASES[case])
    ours = epd_generate(folder, tmp_path, images, text_for(case))
    prompt_ids, tokens = reference_generate(folder, images, text_for(case))
    assert ours["prompt_token_ids"] == prompt_ids
    assert ours["token_ids"] == tokens


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_served_stack_answers_as_epd_generate(epd, aggregated, folder, tmp_path, case):
    images = pictures(CASES[case])
    expected = epd_generate(folder, tmp_path, images, text_for(case))
    for stack in (epd, aggregated):
        for stream in (False, True):
            got, reason, usage = chat(stack, images, text_for(case), stream=stream, max_tokens=MAX_TOKENS,
                                      ignore_eos=True)
            assert got == expected["text"], (stack.run_dir.name, stream)
            assert reason == "length" and usage.completion_tokens == MAX_TOKENS
            assert usage.prompt_tokens == len(expected["prompt_token_ids"])


def test_concurrent_requests_each_answer_as_alone(epd, folder, tmp_path):
    jobs = [(case, stream) for case in sorted(CASES) for stream in (False, True)] * 2
    expected = {case: epd_generate(folder, tmp_path, pictures(CASES[case]), text_for(case))["text"]
                for case in CASES}

    def one(job):
        case, stream = job
        return chat(epd, pictures(CASES[case]), text_for(case), stream=stream, max_tokens=MAX_TOKENS,
                    ignore_eos=True)[0]

    with ThreadPoolExecutor(len(jobs)) as pool:
        answers = list(pool.map(one, jobs))
    assert answers == [expected[case] for case, _ in jobs]
