"""Qwen3-VL through the serving engine: DeepStack levels ride with the image
embeddings into chunked prefill (a chunk that covers part of an image gets
that part of every level), and batched continuous generation equals each
request run alone by the offline loop, which equals the reference's greedy
generate. Checkpoints are written by transformers (qwen3_vl_helpers)."""

from __future__ import annotations

import pytest
import torch

import qwen3_vl_helpers as helpers
from conftest import random_image
from pipeline.engine.engine import Engine, EngineConfig
from pipeline.sampling_params import SamplingParams
from pipeline.generate import GenerationLimits, greedy_generate
from pipeline.models.loader import load_model
from pipeline.models.tiny import default_model_dir
from pipeline.processing.processor import MultimodalPrompt
from pipeline.processing.tokenizer import Tokenizer
from test_engine import run_engine

SIZES = [(160, 192), (32, 32), (224, 96)]


@pytest.fixture(scope="module", params=sorted(helpers.SHAPES))
def qwen3(request, tmp_path_factory):
    folder = helpers.write_checkpoint(tmp_path_factory.mktemp(request.param), helpers.SHAPES[request.param])
    model = load_model(folder).model
    # Token ids past this tokenizer's vocabulary decode to nothing: the
    # engine's text is not what these tests compare.
    return folder, model, Tokenizer.from_checkpoint(default_model_dir())


def make_request(seed: int, num_images: int):
    images = [random_image(*SIZES[(seed + i) % len(SIZES)], seed=seed * 10 + i) for i in range(num_images)]
    inputs = []
    for image in images:
        pixels, grid = helpers.pixels_for([image])
        inputs.append((pixels, tuple(grid[0].tolist())))
    ids, spans = helpers.prompt_ids([g for _, g in inputs], seed=seed)
    return MultimodalPrompt(ids, spans, [g for _, g in inputs]), [f"img-{seed}-{i}" for i in range(num_images)], inputs


def offline(model, prompt, inputs, max_tokens):
    pixels = torch.cat([p for p, _ in inputs]) if inputs else None
    return greedy_generate(model, prompt, pixels, GenerationLimits(max_tokens, frozenset(), ignore_eos=True))


def test_the_offline_loop_equals_the_reference_generate(qwen3):
    from transformers import Qwen3VLForConditionalGeneration

    folder, model, _ = qwen3
    reference = Qwen3VLForConditionalGeneration.from_pretrained(folder, torch_dtype=torch.float32).eval()
    for seed, num_images in ((1, 0), (2, 1), (3, 2)):
        prompt, _, inputs = make_request(seed, num_images)
        ids = torch.tensor([prompt.token_ids])
        # The reference finds image tokens by their type ids.
        kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids),
                      mm_token_type_ids=(ids == helpers.IMAGE_TOKEN).int())
        if inputs:
            kwargs.update(pixel_values=torch.cat([p for p, _ in inputs]),
                          image_grid_thw=torch.tensor([g for _, g in inputs]))
        with torch.no_grad():
            expected = reference.generate(**kwargs, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:].tolist()
        assert offline(model, prompt, inputs, 8) == expected, (seed, num_images)


@pytest.mark.parametrize("aggregated", [False, True])
def test_chunked_batched_requests_equal_each_run_alone(qwen3, aggregated):
    _, model, tokenizer = qwen3
    requests = {f"r{i}": make_request(10 + i, i % 3) for i in range(6)}
    expected = {rid: offline(model, p, inp, 10) for rid, (p, _, inp) in requests.items()}
    # A 16-token budget splits every image of more than a few tokens over chunks.
    assert any(length > 16 for p, _, _ in requests.values() for _, length in p.image_spans)
    arrivals = {0: ["r0", "r1"], 2: ["r2", "r3"], 5: ["r4", "r5"]}
    delay = {key: (5 * hash(key)) % 7 for _, keys, _ in requests.values() for key in keys}
    config = EngineConfig(max_num_batched_tokens=16, max_num_seqs=6, block_size=8, kv_cache_bytes=4 << 20,
                          aggregated=aggregated, local_encode_tokens=512)
    engine = Engine(model, tokenizer, config, torch.device("cpu"))
    outputs, finished = run_engine(engine, model, requests, arrivals, delay, max_tokens=10)
    assert outputs == expected
    assert set(finished.values()) == {"length"}
    assert engine.scheduler.block_pool.num_used == 0 and len(engine.scheduler.encoder_cache) == 0


def test_an_embedding_of_the_wrong_width_is_refused(qwen3):
    _, model, tokenizer = qwen3
    engine = Engine(model, tokenizer, EngineConfig(max_num_batched_tokens=64, kv_cache_bytes=4 << 20),
                    torch.device("cpu"))
    prompt, (key,), ((pixels, grid),) = make_request(4, 1)
    engine.add_request("r", prompt, [key], SamplingParams(max_tokens=2, ignore_eos=True))
    main_only = model.encode_images(pixels, [grid])[0][:, :model.spec.language.hidden_size]
    with pytest.raises(ValueError, match=rf"takes \[tokens, {model.spec.embedding_width}\] rows"):
        engine.add_embedding(key, main_only)
    assert not engine.pending_embeddings



def make_video_request(seed: int, with_image: bool):
    """A clip of 3 temporal patches (random pixels in the tower's patch
    layout) whose frames take runs of their own between stand-in timestamp
    text, after an optional image: one item and one key for three runs.
    Returns (prompt, a key per run, the items' inputs, an input per run)."""
    gen = torch.Generator().manual_seed(seed)
    grid = (3, 4, 6)
    video = (torch.rand(grid[0] * grid[1] * grid[2], 3 * 2 * 16 * 16, generator=gen) * 2 - 1, grid)
    items, keys, per_run, spans = [], [], [], []
    ids = torch.randint(0, 400, (4,), generator=gen).tolist()
    if with_image:
        image = make_request(seed, 1)[2][0]
        items.append(image)
        ids.append(helpers.VISION_START)
        spans.append((len(ids), image[1][0] * image[1][1] * image[1][2] // 4))
        ids += [helpers.IMAGE_TOKEN] * spans[-1][1] + [helpers.VISION_END]
        keys.append(f"img-{seed}")
        per_run.append(image)
    items.append(video)
    for _ in range(grid[0]):
        ids += torch.randint(0, 400, (3,), generator=gen).tolist() + [helpers.VISION_START]
        spans.append((len(ids), grid[1] * grid[2] // 4))
        ids += [helpers.VIDEO_TOKEN] * spans[-1][1] + [helpers.VISION_END]
        keys.append(f"vid-{seed}")
        per_run.append(video)
    ids += torch.randint(0, 400, (5,), generator=gen).tolist()
    return MultimodalPrompt(ids, spans, [g for _, g in items]), keys, items, per_run


@pytest.mark.parametrize("with_image", [False, True])
def test_a_video_of_frame_runs_equals_the_reference_generate(qwen3, with_image):
    from transformers import Qwen3VLForConditionalGeneration

    folder, model, _ = qwen3
    prompt, _, items, _ = make_video_request(5, with_image)
    reference = Qwen3VLForConditionalGeneration.from_pretrained(folder, torch_dtype=torch.float32).eval()
    ids = torch.tensor([prompt.token_ids])
    kinds = (ids == helpers.IMAGE_TOKEN).int() + 2 * (ids == helpers.VIDEO_TOKEN).int()
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=kinds,
                  pixel_values_videos=items[-1][0], video_grid_thw=torch.tensor([items[-1][1]]))
    if with_image:
        kwargs.update(pixel_values=items[0][0], image_grid_thw=torch.tensor([items[0][1]]))
    with torch.no_grad():
        expected = reference.generate(**kwargs, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:].tolist()
    assert offline(model, prompt, items, 8) == expected


@pytest.mark.parametrize("aggregated", [False, True])
def test_chunked_videos_through_the_engine_equal_each_alone(qwen3, aggregated):
    # A 16-token budget cuts the frames' runs and the text between them;
    # each run reads its rows of the one embedding of its clip.
    _, model, tokenizer = qwen3
    made = {f"v{i}": make_video_request(40 + i, bool(i % 2)) for i in range(4)}
    expected = {rid: offline(model, p, items, 8) for rid, (p, _, items, _) in made.items()}
    config = EngineConfig(max_num_batched_tokens=16, max_num_seqs=4, block_size=8, kv_cache_bytes=4 << 20,
                          aggregated=aggregated, local_encode_tokens=512)
    engine = Engine(model, tokenizer, config, torch.device("cpu"))
    requests = {rid: (p, keys, per_run) for rid, (p, keys, _, per_run) in made.items()}
    outputs, finished = run_engine(engine, model, requests, {0: ["v0", "v1"], 3: ["v2", "v3"]}, {}, max_tokens=8)
    assert outputs == expected and set(finished.values()) == {"length"}
    assert engine.scheduler.block_pool.num_used == 0 and len(engine.scheduler.encoder_cache) == 0


def test_runs_of_one_video_must_share_a_key(qwen3):
    _, model, tokenizer = qwen3
    engine = Engine(model, tokenizer, EngineConfig(max_num_batched_tokens=64, kv_cache_bytes=4 << 20),
                    torch.device("cpu"))
    prompt, keys, _, _ = make_video_request(6, False)
    with pytest.raises(ValueError, match="different keys"):
        engine.add_request("r", prompt, keys[:-1] + ["other"], SamplingParams(max_tokens=2, ignore_eos=True))
    with pytest.raises(ValueError, match="placeholder runs"):
        engine.add_request("r", MultimodalPrompt(prompt.token_ids, prompt.image_spans[:2], prompt.grids),
                           keys[:2], SamplingParams(max_tokens=2, ignore_eos=True))
