"""Loading checkpoints: layouts, shards, dtypes, and the errors a user sees."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pipeline.models.attention import ContiguousKVCache
from pipeline.models.errors import ModelLoadError, UnsupportedModelError
from pipeline.models.loader import load_model


def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


def prompt_logits(loaded, ids=(5, 17, 300, 42, 9)):
    model = loaded.model
    text = model.cfg.text
    cache = ContiguousKVCache(text.num_hidden_layers, len(ids), text.num_key_value_heads, text.head_dim,
                              loaded.dtype, loaded.device)
    positions = torch.arange(len(ids)).expand(3, -1)
    with torch.no_grad():
        return model.logits(model(model.embed(torch.tensor(ids)), positions, cache)).float()


def test_sharded_checkpoint_with_index_loads_identically(tiny_dir, tmp_path):
    sharded = copy_checkpoint(tiny_dir, tmp_path / "sharded")
    weights = load_file(sharded / "model.safetensors")
    (sharded / "model.safetensors").unlink()
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, part in shards.items():
        save_file({n: weights[n] for n in part}, sharded / file)
        weight_map.update({n: file for n in part})
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert torch.equal(prompt_logits(load_model(sharded)), prompt_logits(load_model(tiny_dir)))


def test_nested_prefix_layout_loads_identically(tiny_dir, tmp_path):
    """Some transformers 4.x releases wrote `model.language_model.*` and
    `model.visual.*`; both name the same tensors."""
    other = copy_checkpoint(tiny_dir, tmp_path / "nested")
    weights = load_file(other / "model.safetensors")
    renamed = {("model.language_model." + n[len("model."):] if n.startswith("model.") else
                "model." + n if n.startswith("visual.") else n): t for n, t in weights.items()}
    save_file(renamed, other / "model.safetensors")
    assert torch.equal(prompt_logits(load_model(other)), prompt_logits(load_model(tiny_dir)))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_dtypes_track_float32(tiny_dir, dtype):
    loaded = load_model(tiny_dir, dtype=dtype)
    assert all(p.dtype == getattr(torch, dtype) for p in loaded.model.parameters())
    # Rotary tables stay float32 whatever the weights are.
    assert loaded.model.model.rotary.inv_freq.dtype == torch.float32
    low, full = prompt_logits(loaded), prompt_logits(load_model(tiny_dir))
    assert torch.isfinite(low).all()
    assert torch.corrcoef(torch.stack([low.flatten(), full.flatten()]))[0, 1] > 0.99


def drop_tensor(weights):
    del weights["model.layers.1.mlp.up_proj.weight"]


def add_tensor(weights):
    weights["model.layers.9.extra.weight"] = torch.zeros(2)


def reshape_tensor(weights):
    weights["model.norm.weight"] = torch.ones(3)


@pytest.mark.parametrize("edit,message", [
    (drop_tensor, r"1 missing tensors: model\.layers\.1\.mlp\.up_proj\.weight"),
    (add_tensor, r"1 unexpected tensors: model\.layers\.9\.extra\.weight"),
    (reshape_tensor, r"model\.norm\.weight has shape \(3,\)"),
])
def test_mismatched_tensors_are_named(tiny_dir, tmp_path, edit, message):
    broken = copy_checkpoint(tiny_dir, tmp_path / "broken")
    weights = load_file(broken / "model.safetensors")
    edit(weights)
    save_file(weights, broken / "model.safetensors")
    with pytest.raises(ModelLoadError, match=message):
        load_model(broken)


def test_unsupported_architecture(tiny_dir, tmp_path):
    other = copy_checkpoint(tiny_dir, tmp_path / "llama")
    config = json.loads((other / "config.json").read_text())
    config.update(model_type="llama", architectures=["LlamaForCausalLM"])
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="unsupported architecture: model_type='llama'"):
        load_model(other)


@pytest.mark.parametrize("field,value,message", [
    ("num_key_value_heads", 3, "num_attention_heads \\(4\\) must be a positive multiple"),
    ("use_sliding_window", True, "use_sliding_window"),
    ("hidden_size", "big", "'hidden_size' must be a non-negative integer"),
])
def test_invalid_config_field_is_named(tiny_dir, tmp_path, field, value, message):
    other = copy_checkpoint(tiny_dir, tmp_path / "bad")
    config = json.loads((other / "config.json").read_text())
    config[field] = value
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=message):
        load_model(other)


def test_missing_folder_config_and_weights(tiny_dir, tmp_path):
    with pytest.raises(ModelLoadError, match="model folder not found"):
        load_model(tmp_path / "nowhere")
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path)
    other = copy_checkpoint(tiny_dir, tmp_path / "noweights")
    (other / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors weights"):
        load_model(other)


def test_tiny_checkpoint_is_deterministic_and_small(tiny_dir, tmp_path):
    from pipeline.models.tiny import write_tiny_checkpoint

    again = write_tiny_checkpoint(tmp_path / "again")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "preprocessor_config.json"):
        assert (again / name).read_bytes() == (tiny_dir / name).read_bytes(), name
    total = sum(f.stat().st_size for f in again.iterdir())
    assert total < 4 * 1024 * 1024
