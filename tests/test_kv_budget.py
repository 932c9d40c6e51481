"""Sizing the KV cache from GPU memory (--kv-cache-mib auto), on made-up GPUs."""

from __future__ import annotations

import pytest

from pipeline.engine.kv_budget import (
    CUDA_CONTEXT_BYTES, GIB, MIN_RESERVE_BYTES, DeviceMemory, LanguageShape, activation_reserve,
    auto_kv_cache_bytes, embedding_bytes, forward_peak_bytes)

# Qwen2.5-VL-3B's language model in bfloat16.
QWEN_3B = LanguageShape(num_layers=36, kv_heads=2, head_dim=128, hidden_size=2048, intermediate_size=11008,
                        vocab_size=151936, max_context=128000, dtype_bytes=2)
TOKENS, SEQS, BLOCK = 2048, 64, 16
WEIGHTS = 6 * GIB   # the 3B language model's ~3.1B parameters in bfloat16


def h200(free: int | None = None) -> DeviceMemory:
    """141 GiB, our weights loaded; by default nobody else on it."""
    total = 141 * GIB
    return DeviceMemory(total, total - WEIGHTS - CUDA_CONTEXT_BYTES if free is None else free, WEIGHTS)


def size(memory: DeviceMemory, utilization: float = 0.9, reserve: int | None = None) -> int:
    reserve = activation_reserve(QWEN_3B, TOKENS, SEQS) if reserve is None else reserve
    return auto_kv_cache_bytes(memory, utilization, reserve, QWEN_3B.kv_bytes_per_token, TOKENS, BLOCK)


def test_3b_on_an_h200_gets_the_share_less_weights_context_and_reserve():
    reserve = activation_reserve(QWEN_3B, TOKENS, SEQS)
    # A 2048-token step peaks at ~0.35 GiB of activations (counted twice) and
    # the graphs' logits add ~0.6 GiB: under the 1 GiB floor, but not far.
    assert reserve == MIN_RESERVE_BYTES
    kv = size(h200())
    assert kv == int(0.9 * 141 * GIB) - WEIGHTS - CUDA_CONTEXT_BYTES - reserve
    assert 118 * GIB < kv < 120 * GIB
    # 36 KiB per token: about 3.4 million tokens of context across requests.
    assert 3_300_000 < kv // QWEN_3B.kv_bytes_per_token < 3_500_000
    assert size(h200(), utilization=0.5) < 64 * GIB


def test_reserve_grows_with_the_token_budget_and_the_vision_tower():
    floor = activation_reserve(QWEN_3B, TOKENS, SEQS)
    big_steps = activation_reserve(QWEN_3B, 16384, 256)
    # 2 * 16384 tokens * (4 * 2048 + 3 * 11008) * 2 bytes alone is ~2.5 GiB.
    assert big_steps > 2.5 * GIB
    # Aggregated mode: 8192 merged tokens = 32768 patches through the 3B vision MLP.
    vision = forward_peak_bytes(32768, 1280, 3420, 2)
    assert 0.9 * GIB < vision < 1.0 * GIB
    assert activation_reserve(QWEN_3B, TOKENS, SEQS, vision) > floor + 1.5 * GIB


def test_what_is_free_caps_the_share_when_others_hold_the_gpu():
    reserve = activation_reserve(QWEN_3B, TOKENS, SEQS)
    assert size(h200(free=20 * GIB)) == 20 * GIB - reserve
    # Free memory above the share does not raise it.
    assert size(h200(), utilization=0.5) == int(0.5 * 141 * GIB) - WEIGHTS - CUDA_CONTEXT_BYTES - reserve


def test_too_small_for_one_full_step_says_which_numbers_and_flags():
    one_step = TOKENS * QWEN_3B.kv_bytes_per_token   # 72 MiB
    reserve = activation_reserve(QWEN_3B, TOKENS, SEQS)
    assert size(h200(free=reserve + one_step)) == one_step
    with pytest.raises(ValueError) as err:
        size(h200(free=reserve + one_step - 1))
    message = str(err.value)
    assert "\n" not in message
    for text in ("--gpu-memory-utilization", "--max-num-batched-tokens", "--kv-cache-mib", "2048-token",
                 "141.00 GiB", "0.07 GiB"):
        assert text in message, text
    with pytest.raises(ValueError, match="--gpu-memory-utilization"):
        size(h200(), utilization=0.05)   # 7 GiB: less than the weights


@pytest.mark.parametrize("utilization", [0.0, -0.5, 1.01, float("nan")])
def test_utilization_outside_zero_to_one_is_refused(utilization):
    with pytest.raises(ValueError, match=r"must be in \(0, 1\]"):
        size(h200(), utilization=utilization)


def test_wide_embeddings_count_their_real_bytes_in_the_reserve():
    # Qwen3-VL-4B: 2560 wide, three DeepStack levels, so a token's encoder
    # row is 4 x 2560 bf16 (20 KiB); 65536 cached tokens are 1.25 GiB, four
    # times what the same budget costs at the hidden size alone.
    wide = embedding_bytes(65536, 4 * 2560, 2560, 3, TOKENS, 2)
    narrow = embedding_bytes(65536, 2560, 2560, 0, TOKENS, 2)
    assert narrow == 65536 * 2560 * 2
    assert wide == 4 * narrow + 2 * TOKENS * 3 * 2560 * 2
    base = activation_reserve(QWEN_3B, TOKENS, SEQS)
    with_cache = activation_reserve(QWEN_3B, TOKENS, SEQS, embedding_bytes=wide)
    assert with_cache > base and with_cache >= wide
    assert size(h200(), reserve=with_cache) < size(h200(), reserve=base)
