"""Our Qwen2.5-VL against the reference implementation (transformers), on the
tiny checkpoint and on checkpoints written by the reference itself."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from conftest import REPO, image_bytes, random_image
from pipeline.models.attention import ContiguousKVCache
from pipeline.models.loader import load_model
from pipeline.processing.image import open_image, preprocess_images
from pipeline.processing.processor import Processor

pytest.importorskip("transformers")
from reference_oracle import Reference  # noqa: E402

CHECKPOINTS = ["tiny", "gqa4-tied-window4", "mha-window1-deep"]
IMAGE_SETS = {0: [], 1: [(224, 308)], 2: [(37, 91), (330, 200)]}
PROMPT = "Describe what you see, then write a short poem about it."


@pytest.fixture(scope="module")
def checkpoint_dirs(tiny_dir, reference_dirs):
    return {"tiny": tiny_dir, **reference_dirs}


@pytest.fixture(scope="module")
def references(checkpoint_dirs):
    return {name: Reference(path) for name, path in checkpoint_dirs.items()}


@pytest.fixture(scope="module")
def ours(checkpoint_dirs):
    out = {}
    for name, path in checkpoint_dirs.items():
        loaded = load_model(path)
        out[name] = (loaded, Processor.from_checkpoint(path, loaded.config.image_token_id))
    return out


def images_for(n: int):
    return [random_image(h, w, seed=10 + i) for i, (h, w) in enumerate(IMAGE_SETS[n])]


def our_inputs(processor, images):
    decoded = [open_image(image_bytes(im), processor.image_config) for im in images]
    parts = [{"type": "image_url", "image_url": {"url": "x"}} for _ in decoded]
    messages = [{"role": "user", "content": parts + [{"type": "text", "text": PROMPT}]}]
    prompt = processor.chat_prompt(messages, [(im.height, im.width) for im in decoded])
    pixels = preprocess_images(decoded, processor.image_config)[0] if decoded else None
    return prompt, pixels


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_vision_tower_single_and_batched(name, ours, references):
    (loaded, processor), ref = ours[name], references[name]
    images = [random_image(h, w, seed=i) for i, (h, w) in enumerate([(37, 91), (224, 224), (400, 250)])]
    pixels, grid = preprocess_images(images, processor.image_config)
    grids = [tuple(g) for g in grid.tolist()]
    with torch.no_grad():
        expected = ref.model.model.visual(pixels, grid_thw=grid).pooler_output
        batched = loaded.model.encode_images(pixels, grids)
        first = loaded.model.encode_images(pixels[: grid[0].prod()], grids[:1])[0]
    assert [e.shape[0] for e in batched] == [int(g.prod()) // 4 for g in grid]
    assert (torch.cat(batched) - expected).abs().max().item() <= 1e-4
    assert (first - expected[: first.shape[0]]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("name", CHECKPOINTS)
@pytest.mark.parametrize("num_images", [0, 1, 2])
def test_prompt_ids_positions_and_logits(name, num_images, ours, references):
    (loaded, processor), ref = ours[name], references[name]
    images = images_for(num_images)
    prompt, pixels = our_inputs(processor, images)
    expected = ref.inputs(PROMPT, images)
    assert prompt.token_ids == expected.input_ids[0].tolist()
    if images:
        assert torch.equal(pixels, expected.pixel_values)
        assert prompt.grids == [tuple(g) for g in expected.image_grid_thw.tolist()]

    model = loaded.model
    positions, delta = model.prompt_positions(len(prompt.token_ids), prompt.image_spans, prompt.grids)
    if images:
        ref_positions, ref_delta = ref.model.model.get_rope_index(
            expected.input_ids, expected.mm_token_type_ids, expected.image_grid_thw)
        assert torch.equal(positions, ref_positions[:, 0])
        assert delta == int(ref_delta)
    else:
        assert torch.equal(positions, torch.arange(len(prompt.token_ids)).expand(3, -1))
        assert delta == 0

    text = model.cfg.text
    cache = ContiguousKVCache(text.num_hidden_layers, len(prompt.token_ids), text.num_key_value_heads,
                              text.head_dim, torch.float32, torch.device("cpu"))
    with torch.no_grad():
        embeds = model.embed(torch.tensor(prompt.token_ids))
        for (start, length), emb in zip(prompt.image_spans,
                                        model.encode_images(pixels, prompt.grids) if images else []):
            embeds[start:start + length] = emb
        logits = model.logits(model(embeds, positions, cache))
    assert (logits - ref.logits(expected)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("name", CHECKPOINTS)
@pytest.mark.parametrize("num_images", [0, 1, 2])
def test_epd_generate_matches_reference_greedy(name, num_images, checkpoint_dirs, references, tmp_path):
    ref = references[name]
    images = images_for(num_images)
    paths = []
    for i, im in enumerate(images):
        paths += ["--image", str(tmp_path / f"{i}.png")]
        im.save(paths[-1])
    cmd = [sys.executable, str(REPO / "bin" / "epd-generate"), "--model", str(checkpoint_dirs[name]),
           "--prompt", PROMPT, *paths, "--max-tokens", "20", "--json", "--dtype", "float32", "--ignore-eos"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    got = json.loads(run.stdout.strip().splitlines()[-1])
    expected_inputs = ref.inputs(PROMPT, images)
    assert got["prompt_token_ids"] == expected_inputs.input_ids[0].tolist()
    expected = ref.greedy(expected_inputs, 20)
    assert len(expected) == 20
    assert got["token_ids"] == expected
    assert got["text"] == ref.tokenizer.decode(expected, skip_special_tokens=True)


def test_batched_decode_positions_equal_one_request_at_a_time():
    from pipeline.models.qwen2_5_vl import positions

    indices, deltas = [5, 130, 7, 0], [0, -40, 12, 3]
    one_by_one = torch.cat([positions.decode_positions(i, 1, d) for i, d in zip(indices, deltas)], dim=1)
    assert torch.equal(positions.decode_step_positions(indices, deltas), one_by_one)
    assert one_by_one[:, 1].tolist() == [90, 90, 90]


@pytest.mark.parametrize("name", CHECKPOINTS)
@pytest.mark.parametrize("seconds", [0.5, 2 / 24, 2 / 29.97, 1.0])
def test_video_positions_equal_get_rope_index(name, ours, references, seconds):
    # An image, then a video of 4 temporal patches: its time axis steps by
    # tokens_per_second * seconds per temporal patch, truncated as the
    # reference truncates it; text after it resumes as after an image.
    loaded, _ = ours[name]
    ref = references[name]
    cfg = loaded.config
    grids = [(1, 4, 6), (4, 8, 12)]
    ids, spans, kinds = [1, 2, 3], [], []
    for (t, h, w), token, kind in zip(grids, (cfg.image_token_id, cfg.video_token_id), (1, 2)):
        ids.append(cfg.vision_start_token_id)
        spans.append((len(ids), t * h * w // 4))
        ids += [token] * spans[-1][1] + [cfg.vision_end_token_id, 5, 6]
        kinds.append(kind)
    ids += [7, 8]
    positions, delta = loaded.model.prompt_positions(len(ids), spans, grids, [None, seconds])
    input_ids = torch.tensor([ids])
    types = torch.zeros_like(input_ids)
    for (start, length), kind in zip(spans, kinds):
        types[0, start:start + length] = kind
    ref_positions, ref_delta = ref.model.model.get_rope_index(
        input_ids, types, torch.tensor([grids[0]]), torch.tensor([grids[1]]), torch.tensor([seconds]))
    assert torch.equal(positions, ref_positions[:, 0]) and delta == int(ref_delta)
