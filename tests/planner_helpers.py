"""Hand-made box profiles for the planner's tests (test_planner.py,
test_auto_placement.py): curves simple enough to solve by hand."""

from __future__ import annotations

from pipeline.planner.profile import (
    FORMAT, DecodePoint, EngineLimits, ImageGeometry, PrefillPoint, Profile, VisionPoint)

IMAGE_TOKENS = 256  # a 448x448 image with 14-pixel patches merged 2x2: (448 / 28) ** 2
PREFILL_TOKENS = 2048


def make_profile(d0: float = 0.01, d1: float = 0.0, t_p: float = 1e-4, image_s: float = 0.01,
                 vision_beside: float = 1.0, generator_beside: float = 1.0, max_num_seqs: int = 1024,
                 max_num_batched_tokens: int = 8192, prefill_fixed: float = 0.0,
                 decode_context_len: int = 1024) -> Profile:
    """A box whose curves are: decode step d(B) = d0 + d1*B (two points, so the
    line holds everywhere), timed at `decode_context_len` tokens of context;
    prefill prefill_fixed + t_p seconds per prompt token (one point through
    the origin when prefill_fixed is 0, else two on that line); vision
    T(b) = b * image_s for b images of IMAGE_TOKENS (flat per image).
    `*_beside` multiply the alone times for the beside figures."""
    prefill_tokens = (PREFILL_TOKENS,) if prefill_fixed == 0 else (PREFILL_TOKENS // 2, PREFILL_TOKENS)
    return Profile(
        format=FORMAT, model_id="hand-made", device_name="NVIDIA Test GPU", gpu_count=8, dtype="bfloat16",
        mps=True, vision_graphs=0,
        limits=EngineLimits(max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                            encoder_max_batch_tokens=16384, local_encode_tokens=8192),
        image=ImageGeometry(patch_size=14, merge_size=2, min_pixels=3136, max_pixels=1003520),
        vision=[VisionPoint(448, 448, IMAGE_TOKENS, b, b * image_s, b * image_s * vision_beside) for b in (1, 4)],
        decode=[DecodePoint(b, d0 + d1 * b, (d0 + d1 * b) * generator_beside) for b in (1, 64)],
        prefill=[PrefillPoint(n, prefill_fixed + n * t_p, (prefill_fixed + n * t_p) * generator_beside)
                 for n in prefill_tokens],
        decode_context_len=decode_context_len)
