"""A device buffer exported once by CUDA IPC and opened once per consumer.

PyTorch's own per-tensor IPC pays the handle open on every tensor (hundreds
of microseconds); here the whole arena is one allocation, opened once, and
every later handoff is an offset into it. The export is PyTorch's storage
IPC description, carried as plain fields (no pickle).

Consumers must see the producer's GPU under the same index (do not hide it
with CUDA_VISIBLE_DEVICES); a consumer on another GPU reads it peer-to-peer.
"""

from __future__ import annotations

import msgspec
import torch


class CudaExport(msgspec.Struct, frozen=True, array_like=True):
    device: int
    handle: bytes
    storage_bytes: int
    storage_offset: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes
    event_sync_required: bool


def allocate(nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.zeros(nbytes, dtype=torch.uint8, device=device)


def export(buffer: torch.Tensor) -> bytes:
    """The IPC description of `buffer`'s storage, as bytes for ArenaInfo."""
    if buffer.storage_offset() != 0:
        raise ValueError("export the whole allocation, not a view into it")
    fields = buffer.untyped_storage()._share_cuda_()
    return msgspec.msgpack.encode(CudaExport(*fields))


def open_export(data: bytes) -> torch.Tensor:
    """Map a producer's exported buffer into this process (once per arena)."""
    ex = msgspec.msgpack.decode(data, type=CudaExport)
    storage = torch.UntypedStorage._new_shared_cuda(
        ex.device, ex.handle, ex.storage_bytes, ex.storage_offset, ex.ref_counter_handle,
        ex.ref_counter_offset, ex.event_handle, ex.event_sync_required)
    return torch.empty(0, dtype=torch.uint8, device=f"cuda:{ex.device}").set_(storage)
