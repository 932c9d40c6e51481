"""The decoder layer's fused elementwise ops (LayerOps) on Triton kernels,
and optionally its projections on the small-M matmul (gemv)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipeline.kernels.activation import silu_mul
from pipeline.kernels.gemv import gemv
from pipeline.kernels.rmsnorm import add_rms_norm
from pipeline.models.layers import LayerOps, RMSNorm

# Up to this many rows a projection is pure weight streaming, which gemv is
# shaped for; past it cuBLAS's tiles reuse each weight read enough to win.
GEMV_MAX_ROWS = 8


class TritonLayerOps(LayerOps):
    """`gemv_max_rows`: projections of inputs with at most this many rows
    (all leading dims flattened) run gemv with its default config, the rest
    F.linear; 0 keeps F.linear throughout. The choice depends on shapes
    only, so a captured graph holds one or the other."""

    def __init__(self, gemv_max_rows: int = 0) -> None:
        if gemv_max_rows < 0:
            raise ValueError(f"gemv_max_rows={gemv_max_rows}: want >= 0")
        self.gemv_max_rows = gemv_max_rows

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor | None,
                     norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        return add_rms_norm(x, delta, norm.weight, norm.eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_mul(gate_up)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.shape[:-1].numel()
        if 0 < rows <= self.gemv_max_rows:
            return gemv(x, weight, bias)
        return F.linear(x, weight, bias)
