"""Residual add + RMSNorm in one pass over each row.

A pre-norm decoder adds a sub-block's output to the residual stream and
normalises the sum for the next sub-block; unfused that is an add, a cast,
a square, a mean, an rsqrt, two multiplies and casts. Here one program per
row reads x and delta once and writes both the new residual and the
normalised row. Rounding follows the model's RMSNorm: the sum is rounded to
the model dtype (the residual stream lives there), normalised in float32,
rounded again, then multiplied by the weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pipeline.kernels import next_power_of_2
from pipeline.kernels.dependent_launch import launch_options, wait_then_release


@triton.jit
def _add_rms_norm_kernel(x_ptr, delta_ptr, weight_ptr, residual_ptr, out_ptr,
                         x_stride, delta_stride, residual_stride, out_stride, n_cols, eps,
                         HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr, USE_GDC: tl.constexpr):
    wait_then_release(USE_GDC)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:
        x += tl.load(delta_ptr + row * delta_stride + cols, mask=mask, other=0.0).to(tl.float32)
        x = x.to(residual_ptr.dtype.element_ty)
        tl.store(residual_ptr + row * residual_stride + cols, x, mask=mask)
        x = x.to(tl.float32)
    variance = tl.sum(x * x, axis=0) / n_cols
    h = (x * tl.rsqrt(variance + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (h * w).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, delta: [rows, dim] (delta may be None: norm only). Returns the
    residual x + delta and RMSNorm(x + delta) * weight, both in x's dtype."""
    if x.dim() != 2 or x.stride(-1) != 1 or (delta is not None and (delta.shape != x.shape or delta.stride(-1) != 1)):
        raise ValueError(f"add_rms_norm wants [rows, dim] row-major inputs, got {tuple(x.shape)}")
    rows, dim = x.shape
    out = torch.empty_like(x)
    residual = torch.empty_like(x) if delta is not None else x
    block = next_power_of_2(dim)
    _add_rms_norm_kernel[(rows,)](
        x, delta if delta is not None else x, weight, residual, out,
        x.stride(0), delta.stride(0) if delta is not None else 0, residual.stride(0), out.stride(0), dim, eps,
        HAS_DELTA=delta is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)), **launch_options())
    return residual, out


def add_rms_norm_reference(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The unfused ops the decoder layer runs (see pipeline.models.layers.RMSNorm)."""
    if delta is not None:
        x = x + delta
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return x, weight * h.to(x.dtype)
