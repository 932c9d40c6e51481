"""Our Qwen3-VL against the reference implementation (transformers'
Qwen3VLForConditionalGeneration), float32 on the CPU, on checkpoints the
reference writes itself in two shapes (tests/qwen3_vl_helpers.py)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import random_image
from pipeline.models.attention import ContiguousKVCache
from pipeline.models.layers import LayerOps
from pipeline.models.loader import load_model
from pipeline.models.registry import family_for

pytest.importorskip("transformers")
import qwen3_vl_helpers as helpers  # noqa: E402

SHAPES = list(helpers.SHAPES)
IMAGE_SETS = {"none": [], "one": [(96, 160)], "two": [(96, 160), (200, 130)], "tiny": [(32, 32)]}
VISION_TOL = dict(atol=1e-5, rtol=1e-5)
LOGITS_TOL = dict(atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def checkpoint_dirs(tmp_path_factory):
    return {name: helpers.write_checkpoint(tmp_path_factory.mktemp(f"qwen3_vl_{name}"), shape)
            for name, shape in helpers.SHAPES.items()}


@pytest.fixture(scope="module")
def references(checkpoint_dirs):
    from transformers import Qwen3VLForConditionalGeneration

    return {name: Qwen3VLForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
            for name, path in checkpoint_dirs.items()}


@pytest.fixture(scope="module")
def ours(checkpoint_dirs):
    return {name: load_model(path).model for name, path in checkpoint_dirs.items()}


def images_for(key: str):
    return [random_image(h, w, seed=20 + i) for i, (h, w) in enumerate(IMAGE_SETS[key])]


def grids_of(grid_thw: torch.Tensor | None) -> list[tuple[int, int, int]]:
    return [] if grid_thw is None else [tuple(g) for g in grid_thw.tolist()]


def prepared(key: str):
    """(pixels, grid_thw, token ids, image spans) of a prompt with these images."""
    images = images_for(key)
    pixels, grid_thw = helpers.pixels_for(images) if images else (None, None)
    ids, spans = helpers.prompt_ids(grids_of(grid_thw))
    return pixels, grid_thw, ids, spans


def reference_kwargs(ids, pixels, grid_thw) -> dict:
    input_ids = torch.tensor([ids])
    kwargs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                  mm_token_type_ids=(input_ids == helpers.IMAGE_TOKEN).int())
    if pixels is not None:
        kwargs.update(pixel_values=pixels, image_grid_thw=grid_thw)
    return kwargs


def prompt_inputs(model, ids, spans, pixels, grids):
    """Embeddings with each image's main features spliced in, and the
    DeepStack levels aligned with the tokens (zeros at text)."""
    embeds = model.embed(torch.tensor(ids))
    deepstack = embeds.new_zeros(len(ids), model.deepstack_levels, embeds.shape[1])
    for (start, length), features in zip(spans, model.encode_images(pixels, grids) if grids else []):
        main, levels = model.split_features(features)
        embeds[start:start + length] = main
        deepstack[start:start + length] = levels
    return embeds, deepstack


class PlainOps(LayerOps):
    """The fused path's ops written as the unfused layers compute them."""

    def add_rms_norm(self, x, delta, norm):
        x = x if delta is None else x + delta
        return x, norm(x)

    def silu_mul(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up


class FusedKVCache(ContiguousKVCache):
    def layer_ops(self):
        return PlainOps()


def new_cache(model, capacity: int, fused: bool = False) -> ContiguousKVCache:
    text = model.cfg.text
    kind = FusedKVCache if fused else ContiguousKVCache
    return kind(text.num_hidden_layers, capacity, text.num_key_value_heads, text.head_dim,
                torch.float32, torch.device("cpu"))


@torch.no_grad()
def our_greedy(model, ids, spans, pixels, grids, steps: int, fused: bool = False) -> list[int]:
    embeds, deepstack = prompt_inputs(model, ids, spans, pixels, grids)
    positions, delta = model.prompt_positions(len(ids), spans, grids)
    cache = new_cache(model, len(ids) + steps, fused)
    hidden = model(embeds, positions, cache, deepstack if grids else None)
    cache.commit(len(ids))
    tokens = [int(model.logits(hidden[-1]).argmax())]
    while len(tokens) < steps:
        index = len(ids) + len(tokens) - 1
        hidden = model(model.embed(torch.tensor(tokens[-1:])), model.decode_positions(index, 1, delta), cache)
        cache.commit(1)
        tokens.append(int(model.logits(hidden[-1]).argmax()))
    return tokens


# --- config -----------------------------------------------------------------

@pytest.mark.parametrize("name", SHAPES)
def test_config_parsed_from_the_saved_checkpoint(name, checkpoint_dirs, references):
    raw = json.loads((checkpoint_dirs[name] / "config.json").read_text())
    assert family_for(raw).name == "qwen3_vl"
    assert family_for({"architectures": ["Qwen3VLForConditionalGeneration"]}).name == "qwen3_vl"
    cfg = family_for(raw).parse_config(raw)
    ref = references[name].config
    assert cfg.vision.deepstack_visual_indexes == tuple(ref.vision_config.deepstack_visual_indexes)
    assert cfg.deepstack_levels == len(ref.vision_config.deepstack_visual_indexes)
    assert cfg.vision.position_grid_side ** 2 == ref.vision_config.num_position_embeddings
    assert (cfg.vision.patch_size, cfg.vision.out_hidden_size) == (16, ref.text_config.hidden_size)
    assert cfg.text.head_dim == ref.text_config.head_dim
    assert cfg.text.attention_bias == ref.text_config.attention_bias
    assert cfg.text.mrope_section == tuple(ref.text_config.rope_parameters["mrope_section"])
    assert cfg.text.tie_word_embeddings == ref.tie_word_embeddings == helpers.SHAPES[name]["tie"]
    assert (cfg.image_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id) == (
        helpers.IMAGE_TOKEN, helpers.VISION_START, helpers.VISION_END)


def test_hub_config_layout():
    """Hub checkpoints write rope_scaling and rope_theta in text_config and
    tie_word_embeddings at the top level."""
    from pipeline.models.qwen3_vl.config import parse_config

    raw = {"model_type": "qwen3_vl", "tie_word_embeddings": True,
           "text_config": {"head_dim": 128, "rope_theta": 5000000,
                           "rope_scaling": {"mrope_interleaved": True, "mrope_section": [24, 20, 20],
                                            "rope_type": "default"},
                           "hidden_size": 2560, "num_attention_heads": 32, "num_key_value_heads": 8,
                           "eos_token_id": 151645},
           "vision_config": {"out_hidden_size": 2560, "deepstack_visual_indexes": [5, 11, 17]}}
    cfg = parse_config(raw)
    assert cfg.text.rope_theta == 5000000.0 and cfg.text.mrope_section == (24, 20, 20)
    assert cfg.text.tie_word_embeddings and cfg.eos_token_ids == (151645,)
    assert cfg.vision.position_grid_side == 48 and cfg.deepstack_levels == 3


@pytest.mark.parametrize("change, field", [
    (("vision_config", "deepstack_visual_indexes", [0, 3]), "deepstack_visual_indexes"),
    (("vision_config", "deepstack_visual_indexes", [1, 0]), "deepstack_visual_indexes"),
    (("vision_config", "num_position_embeddings", 50), "num_position_embeddings"),
    (("vision_config", "out_hidden_size", 32), "out_hidden_size"),
    (("vision_config", "hidden_act", "relu"), "hidden_act"),
    (("vision_config", "patch_size", [16, 16]), "patch_size"),
    (("text_config", "head_dim", 12), "mrope_section"),
    (("text_config", "num_key_value_heads", 3), "num_key_value_heads"),
    (("rope", "mrope_interleaved", False), "mrope_interleaved"),
])
def test_bad_configs_name_the_field(change, field, checkpoint_dirs):
    from pipeline.models.qwen3_vl.config import parse_config

    raw = json.loads((checkpoint_dirs["taps01"] / "config.json").read_text())
    section, key, value = change
    target = raw["text_config"]["rope_parameters"] if section == "rope" else raw[section]
    target[key] = value
    with pytest.raises(ValueError, match=field):
        parse_config(raw)


# --- vision -----------------------------------------------------------------

@pytest.mark.parametrize("name", SHAPES)
@pytest.mark.parametrize("key", ["two", "tiny"])
def test_vision_main_and_deepstack_levels(name, key, ours, references):
    model, ref = ours[name], references[name]
    pixels, grid_thw = helpers.pixels_for(images_for(key))
    with torch.no_grad():
        expected = ref.model.visual(pixels, grid_thw=grid_thw)
        got = model.encode_images(pixels, grids_of(grid_thw))
    hidden = model.cfg.text.hidden_size
    assert [g.shape for g in got] == [(int(n) // 4, (1 + model.deepstack_levels) * hidden)
                                      for n in grid_thw.prod(-1)]
    assert model.visual.out_dim == got[0].shape[1]
    mains, levels = zip(*(model.split_features(g) for g in got))
    torch.testing.assert_close(torch.cat(mains), expected.pooler_output, **VISION_TOL)
    assert len(expected.deepstack_features) == model.deepstack_levels
    for level, feature in enumerate(expected.deepstack_features):
        torch.testing.assert_close(torch.cat([l[:, level] for l in levels]), feature, **VISION_TOL)


def test_the_vision_tower_alone_equals_the_full_model(checkpoint_dirs, ours):
    """An encoder process loads only `visual` (part="visual")."""
    tower = load_model(checkpoint_dirs["taps123"], part="visual").model
    pixels, grid_thw = helpers.pixels_for(images_for("two"))
    with torch.no_grad():
        alone = tower(pixels, grids_of(grid_thw))
        full = ours["taps123"].encode_images(pixels, grids_of(grid_thw))
    assert all(torch.equal(a, b) for a, b in zip(alone, full))


# --- positions and logits -----------------------------------------------------

@pytest.mark.parametrize("name", SHAPES)
@pytest.mark.parametrize("key", ["none", "one", "two"])
def test_prompt_positions_equal_get_rope_index(name, key, ours, references):
    model, ref = ours[name], references[name]
    pixels, grid_thw, ids, spans = prepared(key)
    positions, delta = model.prompt_positions(len(ids), spans, grids_of(grid_thw))
    kwargs = reference_kwargs(ids, pixels, grid_thw)
    expected, expected_delta = ref.model.get_rope_index(
        kwargs["input_ids"], kwargs["mm_token_type_ids"], grid_thw)
    assert torch.equal(positions, expected[:, 0])
    assert delta == int(expected_delta)
    step = model.decode_step_positions([len(ids), len(ids) + 3], [delta, delta])
    assert step[:, 1].tolist() == [len(ids) + 3 + delta] * 3


@pytest.mark.parametrize("name", SHAPES)
def test_video_frame_positions_equal_get_rope_index(name, ours, references):
    # An image, then a video of 3 temporal patches whose runs are separated
    # by (timestamp) text: the reference splits the video's grid into one
    # t = 1 grid per run; ours takes the video's grid whole.
    model, ref = ours[name], references[name]
    image, video = (1, 4, 6), (3, 6, 4)
    ids, spans, types = [1, 2, helpers.VISION_START], [], []
    spans.append((len(ids), 6))
    ids += [helpers.IMAGE_TOKEN] * 6 + [helpers.VISION_END, 3]
    for frame in range(3):
        ids += [4 + frame, 5, helpers.VISION_START]
        spans.append((len(ids), 6))
        ids += [helpers.VIDEO_TOKEN] * 6 + [helpers.VISION_END]
    ids += [6, 7]
    positions, delta = model.prompt_positions(len(ids), spans, [image, video])
    input_ids = torch.tensor([ids])
    kinds = (input_ids == helpers.IMAGE_TOKEN).int() + 2 * (input_ids == helpers.VIDEO_TOKEN).int()
    expected, expected_delta = ref.model.get_rope_index(input_ids, kinds, torch.tensor([image]),
                                                        torch.tensor([video]))
    assert torch.equal(positions, expected[:, 0]) and delta == int(expected_delta)
    with pytest.raises(ValueError, match="image spans"):
        model.prompt_positions(len(ids), spans[:2], [image, video])   # a run short of the video's 3


@pytest.mark.parametrize("name", SHAPES)
@pytest.mark.parametrize("key", ["none", "two"])
def test_prompt_logits_equal_the_reference(name, key, ours, references):
    model, ref = ours[name], references[name]
    pixels, grid_thw, ids, spans = prepared(key)
    grids = grids_of(grid_thw)
    with torch.no_grad():
        embeds, deepstack = prompt_inputs(model, ids, spans, pixels, grids)
        positions, _ = model.prompt_positions(len(ids), spans, grids)
        logits = model.logits(model(embeds, positions, new_cache(model, len(ids)), deepstack))
        expected = ref(**reference_kwargs(ids, pixels, grid_thw)).logits[0]
        if not grids:   # no image: zero levels and no levels are the same forward
            without = model.logits(model(embeds, positions, new_cache(model, len(ids))))
            assert torch.equal(logits, without)
    torch.testing.assert_close(logits, expected, **LOGITS_TOL)


def test_deepstack_of_the_wrong_shape_is_refused(ours):
    model = ours["taps01"]
    embeds = model.embed(torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="deepstack"):
        model(embeds, model.decode_positions(0, 3, 0), new_cache(model, 3), embeds.new_zeros(3, 1, 64))


# --- decoding -------------------------------------------------------------------

@pytest.mark.parametrize("name", SHAPES)
@pytest.mark.parametrize("key", ["none", "two"])
def test_greedy_decode_equals_reference_generate(name, key, ours, references):
    model, ref = ours[name], references[name]
    pixels, grid_thw, ids, spans = prepared(key)
    with torch.no_grad():
        out = ref.generate(**reference_kwargs(ids, pixels, grid_thw), max_new_tokens=8, min_new_tokens=0,
                           do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = out[0, len(ids):].tolist()
    assert len(expected) == 8
    assert our_greedy(model, ids, spans, pixels, grids_of(grid_thw), 8) == expected


def test_fused_text_path_decodes_the_same(checkpoint_dirs, ours):
    """fuse() (one q/k/v and one gate/up matmul) and a backend with
    LayerOps (residual adds folded into the norms, DeepStack levels added
    between layers) give the plain path's tokens."""
    fused = load_model(checkpoint_dirs["taps123"]).model
    fused.fuse()
    pixels, grid_thw, ids, spans = prepared("two")
    grids = grids_of(grid_thw)
    plain = our_greedy(ours["taps123"], ids, spans, pixels, grids, 8)
    assert our_greedy(fused, ids, spans, pixels, grids, 8, fused=True) == plain


@pytest.mark.parametrize("name", SHAPES)
def test_the_fused_rotary_tower_equals_the_plain_one(name, checkpoint_dirs):
    # fuse() hands the rotary to the ops' kernel (Triton on a GPU); with
    # the plain ops it must give the plain tower's output exactly.
    import copy

    model = load_model(checkpoint_dirs[name]).model
    fused = copy.deepcopy(model.visual)
    fused.fuse(PlainOps())
    pixels, grid_thw = helpers.pixels_for(images_for("two"))
    with torch.no_grad():
        want = torch.cat(model.visual(pixels, grids_of(grid_thw)))
        got = torch.cat(fused(pixels, grids_of(grid_thw)))
    assert fused.ops is not None and torch.equal(got, want)
