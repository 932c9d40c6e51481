"""Named Qwen3-VL shapes: their config.json against transformers' own
reading of it, parameter counts against the reference built on the meta
device, the tiny shape's random model, and the weightless folder
(tokenizer at the real ids, Qwen3-VL chat template and processor settings)."""

from __future__ import annotations

import json

import pytest
import torch

from pipeline.models.loader import load_config
from pipeline.models.registry import family_for
from pipeline.models.shape_configs import QWEN3_VL_SPECIAL_IDS, QWEN25_VL_SPECIAL_IDS, shape_config
from pipeline.models.shape_folder import check_folder_matches, write_shape_folder
from pipeline.models.shapes import random_model
from pipeline.processing.image import ImageProcessorConfig
from pipeline.processing.processor import Processor
from pipeline.processing.tokenizer import Tokenizer

QWEN3_SHAPES = ("qwen3-vl-2b", "qwen3-vl-4b", "qwen3-vl-8b", "qwen3-vl-tiny")
VOCAB = 151936
# Parameters, the tied embedding counted once. Hugging Face lists the
# published checkpoints at 2.13B, 4.44B and 8.77B (bf16 safetensors of about
# 4.3, 8.9 and 17.5 GB); the counts are also checked exactly against the
# reference model built from the same config.
PARAMS = {"qwen3-vl-2b": (2.10e9, 2.16e9), "qwen3-vl-4b": (4.40e9, 4.48e9), "qwen3-vl-8b": (8.72e9, 8.82e9)}


def meta_count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def ours_on_meta(shape: str):
    raw = shape_config(shape)
    family = family_for(raw)
    with torch.device("meta"):
        return family.build(family.parse_config(raw), torch.bfloat16)


@pytest.mark.parametrize("shape", QWEN3_SHAPES)
def test_config_reads_as_the_reference_reads_it(shape):
    transformers = pytest.importorskip("transformers")
    raw = shape_config(shape)
    ref = transformers.Qwen3VLConfig(**raw)
    cfg = family_for(raw).parse_config(raw)
    assert family_for(raw).name == "qwen3_vl"
    text, ref_text = cfg.text, ref.text_config
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "hidden_act",
                 "attention_bias"):
        assert getattr(text, name) == getattr(ref_text, name), name
    rope = ref_text.rope_parameters
    assert (text.rope_theta, list(text.mrope_section)) == (rope["rope_theta"], rope["mrope_section"])
    assert rope["mrope_interleaved"] is True and text.tie_word_embeddings == ref.tie_word_embeddings
    vision, ref_vision = cfg.vision, ref.vision_config
    for name in ("depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size", "patch_size",
                 "temporal_patch_size", "spatial_merge_size", "in_channels", "hidden_act",
                 "num_position_embeddings"):
        assert getattr(vision, name) == getattr(ref_vision, name), name
    assert list(vision.deepstack_visual_indexes) == ref_vision.deepstack_visual_indexes
    assert (cfg.image_token_id, cfg.video_token_id, cfg.vision_start_token_id, cfg.vision_end_token_id) == (
        ref.image_token_id, ref.video_token_id, ref.vision_start_token_id, ref.vision_end_token_id) == (
        151655, 151656, 151652, 151653)


def test_4b_is_the_published_layout():
    raw = shape_config("qwen3-vl-4b")
    text, vision = raw["text_config"], raw["vision_config"]
    assert (text["hidden_size"], text["num_hidden_layers"], text["num_attention_heads"],
            text["num_key_value_heads"], text["head_dim"], text["intermediate_size"], text["vocab_size"]) == (
        2560, 36, 32, 8, 128, 9728, VOCAB)
    assert raw["tie_word_embeddings"] is True and text["rope_theta"] == 5000000
    assert text["rope_scaling"] == {"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True}
    assert (vision["depth"], vision["hidden_size"], vision["intermediate_size"], vision["num_heads"],
            vision["out_hidden_size"], vision["patch_size"], vision["temporal_patch_size"],
            vision["spatial_merge_size"], vision["num_position_embeddings"], vision["hidden_act"]) == (
        24, 1024, 4096, 16, 2560, 16, 2, 2, 2304, "gelu_pytorch_tanh")
    assert vision["deepstack_visual_indexes"] == [5, 11, 17]


@pytest.mark.parametrize("shape", sorted(PARAMS))
def test_parameter_count_on_meta_matches_reference(shape):
    transformers = pytest.importorskip("transformers")
    model = ours_on_meta(shape)
    total = meta_count(model)
    print(f"{shape}: {total:,} parameters ({meta_count(model.visual):,} in the vision tower)")
    low, high = PARAMS[shape]
    assert low < total < high
    with torch.device("meta"):
        reference = transformers.Qwen3VLForConditionalGeneration(transformers.Qwen3VLConfig(**shape_config(shape)))
    assert total == meta_count(reference)
    assert meta_count(model.visual) == meta_count(reference.model.visual)


def test_4b_parameter_count_exactly():
    model = ours_on_meta("qwen3-vl-4b")
    assert meta_count(model) == 4_437_815_808 and meta_count(model.visual) == 415_347_712
    assert not hasattr(model, "lm_head")  # tied: the embedding table is the output head


def test_tiny_random_model_parts():
    cpu = torch.device("cpu")
    tower = random_model("qwen3-vl-tiny", torch.float32, cpu, part="visual")
    language = random_model("qwen3-vl-tiny", torch.float32, cpu, part="language").model
    full = random_model("qwen3-vl-tiny", torch.float32, cpu)
    assert full.family.name == "qwen3_vl" and full.config.deepstack_levels == 2
    assert not any(p.is_meta for p in tower.model.parameters())
    assert all(p.is_meta for p in language.visual.parameters())
    assert not any(p.is_meta for p in language.model.parameters())
    params = dict(full.model.named_parameters())
    assert params["model.embed_tokens.weight"].shape == (VOCAB, 64)
    assert torch.equal(params["visual.blocks.0.norm1.weight"], torch.ones(32))
    assert torch.equal(params["visual.blocks.0.norm1.bias"], torch.zeros(32))
    assert float(params["visual.pos_embed.weight"].std()) == pytest.approx(0.02, rel=0.1)


@pytest.fixture(scope="module")
def folder_4b(tmp_path_factory):
    return write_shape_folder("qwen3-vl-4b", tmp_path_factory.mktemp("qwen3-vl-4b"))


def test_folder_tokenizer_has_the_real_ids(folder_4b):
    assert set(QWEN25_VL_SPECIAL_IDS.items()) < set(QWEN3_VL_SPECIAL_IDS.items())
    tokenizer = Tokenizer.from_checkpoint(folder_4b)
    assert tokenizer.vocab_size == VOCAB
    assert tokenizer.eos_token_ids == (151645, 151643) and tokenizer.pad_token_id == 151643
    for token, token_id in QWEN3_VL_SPECIAL_IDS.items():
        assert tokenizer.encode(token) == [token_id]


def test_folder_config_parses_with_the_family(folder_4b, tmp_path):
    family, config = load_config(folder_4b)
    assert family.name == "qwen3_vl" and config.text.hidden_size == 2560
    assert json.loads((folder_4b / "config.json").read_text()) == shape_config("qwen3-vl-4b")
    check_folder_matches("qwen3-vl-4b", folder_4b)
    with pytest.raises(ValueError, match="has vision_config="):
        check_folder_matches("qwen3-vl-tiny", folder_4b)
    # The vocabulary and widths sit under text_config in this family.
    changed = shape_config("qwen3-vl-4b")
    changed["text_config"]["vocab_size"] = 152064
    (tmp_path / "config.json").write_text(json.dumps(changed))
    with pytest.raises(ValueError, match="has text_config="):
        check_folder_matches("qwen3-vl-4b", tmp_path)


def test_folder_processor_settings_are_the_published_ones(folder_4b, tmp_path):
    pytest.importorskip("transformers")
    import qwen3_vl_helpers as helpers

    helpers.published_image_processor().save_pretrained(tmp_path)
    assert ImageProcessorConfig.from_checkpoint(folder_4b) == ImageProcessorConfig.from_checkpoint(tmp_path)


def test_folder_chat_prompt(folder_4b):
    _, config = load_config(folder_4b)
    processor = Processor.from_checkpoint(folder_4b, config.image_token_id)
    assert processor.image_grid(640, 640) == (1, 40, 40)  # 16-pixel patches: 400 visual tokens
    message = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}},
                                           {"type": "text", "text": "describe the image"}]}
    prompt = processor.chat_prompt([message], [(640, 640)])
    (start, length), = prompt.image_spans
    assert length == 400 and set(prompt.token_ids[start:start + length]) == {151655}
    # No default system prompt: the prompt opens with the user's turn.
    assert prompt.token_ids[:2] == [151644, processor.tokenizer.token_id("user")]
    assert prompt.token_ids[start - 1] == 151652 and prompt.token_ids[start + length] == 151653
