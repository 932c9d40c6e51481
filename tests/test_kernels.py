"""The Triton kernels of the CUDA fast-decode path, run on the CPU by Triton's
interpreter (TRITON_INTERPRET=1) against their PyTorch references, then the
whole fused decode forward against the unfused one.

Skipped where triton is not installed (CI): the kernels only ever run on the
fast-decode path of a CUDA generator, and scripts/gpu_engine_check.py checks
them there on the real device.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed: the fused decode kernels are CUDA-only extras", allow_module_level=True)
if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("triton was imported without its interpreter; run this file alone", allow_module_level=True)
# Triton fixes interpreter-or-compiler for its own helpers when it is first
# imported and checks again at each launch, so the switch is set before that
# import and stays on for the session; nothing else in the suite runs triton.
os.environ["TRITON_INTERPRET"] = "1"
import triton  # noqa: E402,F401

TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=2e-2)}
DTYPES = [torch.float32, torch.bfloat16]


def kernel(name: str):
    return importlib.import_module(f"pipeline.kernels.{name}")


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCE[want.dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm(dtype, with_delta):
    gen = torch.Generator().manual_seed(0)
    x, delta = (torch.randn(5, 300, generator=gen).to(dtype) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(300, generator=gen)).to(dtype)
    m = kernel("rmsnorm")
    residual, out = m.add_rms_norm(x, delta if with_delta else None, weight, 1e-6)
    want_residual, want_out = m.add_rms_norm_reference(x, delta if with_delta else None, weight, 1e-6)
    assert residual.dtype == out.dtype == dtype
    close(residual, want_residual)
    close(out, want_out)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(dtype):
    gate_up = torch.randn(3, 2 * 700, generator=torch.Generator().manual_seed(1)).to(dtype)
    m = kernel("activation")
    got = m.silu_mul(gate_up, block=256)  # several column blocks, the last one partial
    assert got.shape == (3, 700)
    close(got, m.silu_mul_reference(gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_and_cache_write(dtype):
    gen = torch.Generator().manual_seed(2)
    tokens, heads, kv_heads, dim, slots = 4, 16, 2, 64, 40
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim, generator=gen).to(dtype)
    angles = torch.randn(tokens, dim // 2, generator=gen) * 3
    angles = torch.cat([angles, angles], -1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    cache = torch.randn(2, slots, kv_heads, dim, generator=gen).to(dtype)
    slot_mapping = torch.tensor([7, 0, 33, 39])
    m = kernel("rotary_kv")
    got_k, got_v = cache[0].clone(), cache[1].clone()
    want_k, want_v = cache[0].clone(), cache[1].clone()
    q = m.rotary_kv_write(qkv, cos, sin, heads, got_k, got_v, slot_mapping)
    want_q = m.rotary_kv_write_reference(qkv, cos, sin, heads, want_k, want_v, slot_mapping)
    close(q, want_q)
    close(got_k, want_k)
    assert torch.equal(got_v, want_v)  # v is copied, not computed
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[slot_mapping] = False
    assert torch.equal(got_k[untouched], cache[0][untouched])


def paged_case(dtype, lengths, heads=16, kv_heads=2, dim=128, page=16, seed=3):
    """Random cache; each sequence's blocks scattered through it (shuffled, not
    contiguous); a last padding row of length 1 whose table is all the null block."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-n // page) for n in lengths) + 3
    null = num_blocks - 1
    order = torch.randperm(num_blocks - 1, generator=gen).tolist()
    width = max(-(-n // page) for n in lengths) + 1
    tables = torch.full((len(lengths) + 1, width), null)
    for i, n in enumerate(lengths):
        used = -(-n // page)
        tables[i, :used] = torch.tensor(order[:used])
        order = order[used:]
    k_slots, v_slots = (torch.randn(num_blocks * page, kv_heads, dim, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(len(lengths) + 1, heads, dim, generator=gen).to(dtype)
    return q, k_slots, v_slots, tables, torch.tensor(list(lengths) + [1]), page


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("splits", [None, (1, 320), (3, 128), (10, 32)])
def test_paged_decode_attention(dtype, splits):
    """Lengths 1, 17 and 300 with GQA 8:1, against per-sequence SDPA; one
    split (direct write) and several (partials merged, some splits empty)."""
    m = kernel("decode_attention")
    q, k_slots, v_slots, tables, lengths, page = paged_case(dtype, [1, 17, 300])
    num_splits, split_len = splits or m.plan_splits(len(lengths), 2, 320, num_sms=4)
    got = m.paged_decode_attention(q, k_slots, v_slots, tables, lengths, page, num_splits, split_len)
    want = m.paged_decode_attention_reference(q, k_slots, v_slots, tables, lengths, page)
    close(got, want)


def test_paged_decode_attention_small_heads_and_odd_group():
    """Head dim 16 and a group of 3 q heads per kv head: padded tiles masked."""
    m = kernel("decode_attention")
    q, k_slots, v_slots, tables, lengths, page = paged_case(torch.float32, [5, 40], heads=6, kv_heads=2, dim=16,
                                                            page=8)
    got = m.paged_decode_attention(q, k_slots, v_slots, tables, lengths, page, 2, 32)
    close(got, m.paged_decode_attention_reference(q, k_slots, v_slots, tables, lengths, page))


@pytest.mark.parametrize("batch,max_len", [(1, 1024), (32, 1024), (4, 256), (1, 16), (64, 4096)])
def test_plan_splits_covers_every_key(batch, max_len):
    m = kernel("decode_attention")
    num_splits, split_len = m.plan_splits(batch, 2, max_len, num_sms=132)
    assert split_len % 32 == 0
    assert num_splits * split_len >= max_len > (num_splits - 1) * split_len


def small_model(dtype: torch.dtype):
    """A two-layer random Qwen2.5-VL language model with GQA 8:1 and head dim 32."""
    from pipeline.models.qwen2_5_vl.config import Qwen25VLConfig, TextConfig, VisionConfig
    from pipeline.models.qwen2_5_vl.model import Qwen25VL

    text = TextConfig(vocab_size=300, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=1, rms_norm_eps=1e-6, rope_theta=10000.0,
                      mrope_section=(4, 6, 6), max_position_embeddings=4096, hidden_act="silu",
                      tie_word_embeddings=True)
    vision = VisionConfig(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=256,
                          patch_size=14, temporal_patch_size=2, spatial_merge_size=2, window_size=112,
                          fullatt_block_indexes=(0,), in_channels=3, hidden_act="silu", rope_theta=10000.0)
    cfg = Qwen25VLConfig(vision, text, 299, 298, 297, 296, (295,))
    torch.manual_seed(4)
    model = Qwen25VL(cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.8, 1.2)
            else:
                param.normal_(0.0, 0.1)
    model = model.to(dtype).eval().requires_grad_(False)
    model.reset_buffers()  # rotary tables in float32 whatever the dtype, as loading makes them
    return model


def run_decode(model, fused: bool, cache_init, dtype):
    from pipeline.engine.decode_graphs import DecodeGraphs
    from pipeline.engine.paged_attention import PagedKVCache

    text = model.cfg.text
    cache = PagedKVCache(text.num_hidden_layers, 20, 16, text.num_key_value_heads, text.head_dim, dtype,
                         torch.device("cpu"))
    cache.keys.copy_(cache_init[0])
    cache.values.copy_(cache_init[1])
    graphs = DecodeGraphs(model, cache, null_block=19, max_batch=4, max_len=300, device=torch.device("cpu"),
                          use_graphs=False, min_len=64, fused=fused)
    assert graphs.fused == fused
    context_lens = [0, 17, 130]
    tables = [[5], [11, 2], [3, 18, 0, 9, 14, 7, 1, 12, 16]]
    positions = torch.tensor([[n + 7 * i for i, n in enumerate(context_lens)]] * 3)
    positions[1] += 1  # M-RoPE axes that differ
    with torch.inference_mode():
        logits = graphs.run([5, 77, 201], positions, tables, context_lens)
    return logits, cache


def test_fused_decode_forward_equals_unfused():
    """DecodeGraphs with the Triton kernels (rotary + cache write, paged
    attention, fused add + norm, SiLU * up) against its gather path, float32,
    from the same cache: the same logits and the same K/V written."""
    model = small_model(torch.float32)
    model.fuse()
    gen = torch.Generator().manual_seed(5)
    init = [torch.randn(2, 20, 16, 1, 32, generator=gen) for _ in range(2)]
    fused_logits, fused_cache = run_decode(model, True, init, torch.float32)
    plain_logits, plain_cache = run_decode(model, False, init, torch.float32)
    tolerance = dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(fused_logits, plain_logits, **tolerance)
    torch.testing.assert_close(fused_cache.keys, plain_cache.keys, **tolerance)
    torch.testing.assert_close(fused_cache.values, plain_cache.values, **tolerance)
    assert torch.equal(fused_logits.argmax(-1), plain_logits.argmax(-1))


def test_fused_decode_bfloat16_is_as_accurate_as_unfused():
    """In bf16 the two paths round differently, so each is compared with the
    float32 model: the fused one may not be much further from it."""
    gen = torch.Generator().manual_seed(5)
    init = [torch.randn(2, 20, 16, 1, 32, generator=gen).to(torch.bfloat16) for _ in range(2)]
    exact = small_model(torch.float32)
    exact.fuse()
    want, _ = run_decode(exact, False, [t.float() for t in init], torch.float32)
    model = small_model(torch.bfloat16)
    model.fuse()
    errors = {}
    for fused in (True, False):
        logits, _ = run_decode(model, fused, init, torch.bfloat16)
        errors[fused] = (logits.float() - want).abs().max().item()
    assert errors[True] <= 1.5 * errors[False] + 0.02 * want.abs().max().item(), errors


def test_unfused_projections_still_work_with_the_fused_backend():
    """A model never fuse()d takes the backend's attend() (cache write by
    index_copy) and the plain MLP, with the fused norms around them."""
    model = small_model(torch.float32)
    init = [torch.zeros(2, 20, 16, 1, 32) for _ in range(2)]
    fused_logits, _ = run_decode(model, True, init, torch.float32)
    plain_logits, _ = run_decode(model, False, init, torch.float32)
    torch.testing.assert_close(fused_logits, plain_logits, atol=1e-4, rtol=1e-4)
