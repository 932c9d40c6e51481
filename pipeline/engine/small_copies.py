"""Small per-step tensors (row indices, per-row settings, uniforms) to the
device without stalling the host.

`torch.tensor(values, device=cuda)` copies from pageable memory and waits
for the stream to drain: issued after the forward is launched, it waits for
the whole forward, and every later host work of the step runs after it. A
copy from pinned memory with non_blocking=True is queued behind the forward
instead; the caching host allocator keeps the pinned block alive until the
copy is done.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def device_tensor(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` (a list, or a list of equal-length lists) as a tensor on
    `device`: one queued copy on CUDA, the host tensor itself elsewhere."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
