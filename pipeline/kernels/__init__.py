"""Triton kernels for the CUDA fast-decode path.

Each module holds one fused kernel, its launcher and a plain PyTorch
reference that the tests compare it against. Nothing here imports triton at
package import: the model and engine code must load on machines without it
(CI), and only the fast-decode path asks for these kernels.
"""

from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """Triton's CPU interpreter is on (TRITON_INTERPRET=1): what the tests use."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def available(device: torch.device) -> bool:
    """The kernels can run on `device`: triton imports, and the device is a
    CUDA one, or the interpreter is on (any device, for tests)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return device.type == "cuda" or interpreting()


def next_power_of_2(n: int) -> int:
    """tl.arange needs power-of-two extents; sizes are padded up and masked."""
    return 1 << max(0, n - 1).bit_length()
