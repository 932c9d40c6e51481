"""SiLU(gate) * up on the fused gate_up projection's output.

The fused MLP projection writes [rows, 2 * hidden] (gate then up); unfused,
chunk + silu + mul is two kernels and an intermediate. Rounding follows
F.silu(gate) * up in the model dtype: the SiLU is rounded before the multiply.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pipeline.kernels.dependent_launch import launch_options, wait_then_release


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, x_stride, out_stride, n_cols, BLOCK: tl.constexpr, USE_GDC: tl.constexpr):
    wait_then_release(USE_GDC)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """gate_up: [rows, 2 * hidden] -> silu(gate) * up: [rows, hidden]."""
    if gate_up.dim() != 2 or gate_up.shape[1] % 2 or gate_up.stride(-1) != 1:
        raise ValueError(f"silu_mul wants [rows, 2 * hidden] row-major, got {tuple(gate_up.shape)}")
    rows, hidden = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(rows, hidden)
    _silu_mul_kernel[(rows, triton.cdiv(hidden, block))](gate_up, out, gate_up.stride(0), out.stride(0),
                                                        hidden, BLOCK=block, num_warps=4, **launch_options())
    return out


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
