"""Building blocks shared by model families."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, scaled in the input dtype (as the reference
    does: the cast back happens before the weight multiply)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if x.is_cuda:
            # One fused kernel instead of five; same formula. Off the GPU the
            # reference's own ops are kept, so float32 rounding matches it.
            return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(dtype)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class LayerOps(ABC):
    """Fused kernels that a fast path runs in place of a decoder layer's
    elementwise ops (pipeline.kernels implements them with Triton), and the
    matmul its projections go through. Same formulas as RMSNorm, GatedMLP
    and nn.Linear; results agree within the model dtype's rounding, not bit
    for bit."""

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """F.linear's contract (weight [out, in]); an implementation may pick
        another kernel by x's shape, never by its values (the fast paths
        capture it in CUDA graphs)."""
        return F.linear(x, weight, bias)

    @abstractmethod
    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor | None,
                     norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, norm(x + delta)); delta None means just (x, norm(x))."""

    @abstractmethod
    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[rows, 2 * hidden] (gate then up) -> silu(gate) * up."""

    def gated_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """silu_mul(linear(x, weight, bias)), weight [2 * hidden, in] gate rows
        then up rows; an implementation may fuse the two (by shape only, as
        linear chooses)."""
        return self.silu_mul(self.linear(x, weight, bias))

    def rotate_qk_(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The vision tower's rotary: q and k of a packed [tokens, 3, heads,
        head_dim] qkv rotated in place, in float32 (cos/sin float32 [tokens,
        head_dim]); returns qkv."""
        qkv[:, :2] = rotate_float(qkv[:, :2], cos, sin)
        return qkv


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, dim: int, hidden: int, bias: bool) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)
        self.gate_up: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.down: tuple[torch.Tensor, torch.Tensor | None] | None = None   # set by fuse()

    def fuse(self, pad_to: int = 1) -> None:
        """One matmul for gate and up; the two weights become views of it.
        `pad_to`: the hidden width is padded with zeros up to a multiple of
        it (silu(0) * 0 = 0 and down's padded columns are 0, so the output
        is the same). For widths like the Qwen2.5-VL vision MLP's 3420,
        cuBLAS falls back to unaligned kernels: on an H200 those ran at 240
        TFLOP/s against 750 for the tower's aligned projections."""
        hidden, dim = self.gate_proj.weight.shape
        padded = -(-hidden // pad_to) * pad_to
        weight = self.gate_proj.weight.new_zeros(2 * padded, dim)
        weight[:hidden], weight[padded:padded + hidden] = self.gate_proj.weight.data, self.up_proj.weight.data
        self.gate_proj.weight.data, self.up_proj.weight.data = weight[:hidden], weight[padded:padded + hidden]
        bias = None
        if self.gate_proj.bias is not None:
            bias = weight.new_zeros(2 * padded)
            bias[:hidden], bias[padded:padded + hidden] = self.gate_proj.bias.data, self.up_proj.bias.data
            self.gate_proj.bias.data, self.up_proj.bias.data = bias[:hidden], bias[padded:padded + hidden]
        self.gate_up = (weight, bias)
        down = self.down_proj.weight
        if padded != hidden:
            wide = down.new_zeros(dim, padded)
            wide[:, :hidden] = down.data
            self.down_proj.weight.data = wide[:, :hidden]
            down = wide
        self.down = (down, self.down_proj.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is None:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        gate, up = F.linear(x, *self.gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, *self.down)

    def forward_fused(self, x: torch.Tensor, ops: LayerOps) -> torch.Tensor:
        if self.gate_up is None:
            return self.forward(x)
        return ops.linear(ops.gated_linear(x, *self.gate_up), *self.down)


def fuse_linears(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for projections that read the same input: the
    weights move into one tensor and each linear's become views of it (no
    extra memory). Returns the merged (weight, bias)."""
    weight = torch.cat([l.weight.data for l in linears])
    bias = torch.cat([l.bias.data for l in linears]) if linears[0].bias is not None else None
    start = 0
    for linear in linears:
        rows = linear.weight.shape[0]
        linear.weight.data = weight[start:start + rows]
        if bias is not None:
            linear.bias.data = bias[start:start + rows]
        start += rows
    return weight, bias


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate_float(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, ..., dim]; cos/sin: [tokens, dim] in float32. Rotary
    computed in float32 whatever x's dtype (what the vision tower's
    reference does), returned in x's dtype."""
    xf = x.float()
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    return (xf * cos.view(shape) + rotate_half(xf) * sin.view(shape)).to(x.dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [tokens, heads, dim]; cos/sin: [tokens, dim] in x's dtype."""
    cos = cos.unsqueeze(-2)
    sin = sin.unsqueeze(-2)
    return x * cos + rotate_half(x) * sin
