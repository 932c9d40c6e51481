"""A serving-ready tiny Qwen3-VL folder (tests/qwen3_vl_helpers.py) read by
our stack and by the reference: prompt token ids from our Processor equal
the reference Qwen3VLProcessor's input_ids (its chat template, then its
processor call with the images), and so do the grids, the image spans and,
through the encoder's decode path, the pixels."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import image_bytes, random_image
from pipeline.media.pillow_backend import PillowBackend
from pipeline.models.loader import load_config, load_model
from pipeline.processing.processor import Processor

pytest.importorskip("transformers")
import qwen3_vl_helpers as helpers  # noqa: E402

# (height, width) of each image part, in order.
CHATS = {
    "text-only": ([{"role": "user", "content": "Describe the weather in the photo."}], []),
    "one-image": ([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "What do you see in this image?"}]}], [(20, 30)]),
    "two-images": ([{"role": "user", "content": [
        {"type": "text", "text": "Count the apples:"}, {"type": "image"},
        {"type": "text", "text": " and the oranges:"}, {"type": "image"}]}], [(333, 517), (1100, 700)]),
    "system-and-turns": ([
        {"role": "system", "content": [{"type": "text", "text": "Please answer with a single word."}]},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Is it a dog?"}]},
        {"role": "assistant", "content": "Yes."},
        {"role": "user", "content": "And the car?"}], [(96, 160)]),
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return helpers.write_serving_checkpoint(tmp_path_factory.mktemp("qwen3-vl-serving"))


@pytest.fixture(scope="module")
def reference(folder):
    return helpers.reference_processor(folder)


@pytest.fixture(scope="module")
def ours(folder):
    _, config = load_config(folder)
    return Processor.from_checkpoint(folder, config.image_token_id)


def images_of(sizes):
    return [random_image(h, w, seed=h * 7 + w) for h, w in sizes]


def as_openai(messages):
    """The same chat as a client sends it: image parts as image_url."""
    url = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    return [{**m, "content": [url if p.get("type") == "image" else p for p in m["content"]]}
            if isinstance(m["content"], list) else m for m in messages]


def reference_inputs(reference, messages, images):
    text = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return reference(text=[text], images=images or None, return_tensors="np")


def test_both_sides_load_the_folder(folder, reference, ours):
    family, config = load_config(folder)
    assert family.name == "qwen3_vl"
    assert config.image_token_id == reference.image_token_id == ours.tokenizer.token_id("<|image_pad|>")
    assert ours.image_config.patch_size == reference.image_processor.patch_size == 16
    assert ours.tokenizer.eos_token_ids == (ours.tokenizer.token_id("<|im_end|>"),
                                            ours.tokenizer.token_id("<|endoftext|>"))
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == list(
        ours.tokenizer.eos_token_ids)
    model = load_model(folder).model
    assert model.deepstack_levels == len(helpers.SHAPES["taps01"]["vision"]["deepstack_visual_indexes"])


@pytest.mark.parametrize("name", sorted(CHATS))
def test_prompt_ids_match_reference(reference, ours, name):
    messages, sizes = CHATS[name]
    expected = reference_inputs(reference, messages, images_of(sizes))
    prompt = ours.chat_prompt(as_openai(messages), sizes)
    assert prompt.token_ids == expected["input_ids"][0].tolist()
    reference_grids = [tuple(g) for g in expected["image_grid_thw"].tolist()] if sizes else []
    assert prompt.grids == reference_grids
    # Each span covers exactly the reference's image-token run, in order.
    marks = np.zeros(len(prompt.token_ids), dtype=np.int64)
    for start, length in prompt.image_spans:
        marks[start:start + length] = 1
    assert marks.tolist() == expected["mm_token_type_ids"][0].tolist()


def test_prompt_ids_match_the_reference_tokenizing_chat_template(reference, ours):
    """The reference's one-call path (apply_chat_template with images in the messages)."""
    messages, sizes = CHATS["two-images"]
    images = iter(images_of(sizes))
    with_images = [{**m, "content": [{"type": "image", "image": next(images)} if p["type"] == "image" else p
                                     for p in m["content"]]} for m in messages]
    expected = reference.apply_chat_template(with_images, tokenize=True, add_generation_prompt=True,
                                             return_dict=True)
    assert ours.chat_prompt(as_openai(messages), sizes).token_ids == expected["input_ids"][0]


def test_template_has_no_default_system_prompt(ours):
    text = ours.template.render(CHATS["text-only"][0])
    assert text == "<|im_start|>user\nDescribe the weather in the photo.<|im_end|>\n<|im_start|>assistant\n"


def test_pixels_through_the_encoder_path_match_reference(folder, reference, ours):
    messages, sizes = CHATS["two-images"]
    images = images_of(sizes)
    expected = reference_inputs(reference, messages, images)
    with PillowBackend("cpu", num_threads=1) as backend:
        decoded = backend.decode([image_bytes(image) for image in images], ours.image_config)
    pixels = np.concatenate([d.pixel_values.numpy() for d in decoded])
    assert np.array_equal(pixels, expected["pixel_values"])
