"""The fused elementwise ops of decoder layers and vision blocks (LayerOps)
on Triton kernels, and optionally the projections on the small-M matmul
(gemv)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipeline.kernels.activation import silu_mul
from pipeline.kernels.gemv import beats_cublas, gemv, gemv_silu_mul
from pipeline.kernels.rmsnorm import add_rms_norm
from pipeline.kernels.vision_rotary import rotate_qk_
from pipeline.models.layers import LayerOps, RMSNorm


class TritonLayerOps(LayerOps):
    """`use_gemv`: projections run the small-M Triton matmul wherever it was
    measured faster than cuBLAS (gemv.beats_cublas: few rows), F.linear
    elsewhere. The choice depends on shapes only, so a captured graph holds
    one or the other."""

    def __init__(self, use_gemv: bool = False) -> None:
        self.use_gemv = use_gemv

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor | None,
                     norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        return add_rms_norm(x, delta, norm.weight, norm.eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_mul(gate_up)

    def rotate_qk_(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return rotate_qk_(qkv, cos, sin)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.gemv_for(x, weight):
            return gemv(x, weight, bias)
        return F.linear(x, weight, bias)

    def gated_linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        # Where gemv runs the projection, its epilogue applies the SiLU: one
        # kernel instead of two in every decode layer's MLP.
        if self.gemv_for(x, weight):
            return gemv_silu_mul(x, weight, bias)
        return super().gated_linear(x, weight, bias)

    def gemv_for(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        """Whether linear(x, weight) runs on gemv."""
        return self.use_gemv and beats_cublas(x.shape[:-1].numel(), weight.shape[0])
