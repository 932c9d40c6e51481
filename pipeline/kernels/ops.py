"""The decoder layer's fused elementwise ops (LayerOps) on Triton kernels."""

from __future__ import annotations

import torch

from pipeline.kernels.activation import silu_mul
from pipeline.kernels.rmsnorm import add_rms_norm
from pipeline.models.layers import LayerOps, RMSNorm


class TritonLayerOps(LayerOps):
    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor | None,
                     norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        return add_rms_norm(x, delta, norm.weight, norm.eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_mul(gate_up)
