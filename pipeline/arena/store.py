"""The producer's arena: the index plus the memory it describes.

Two shared parts per arena:
- data: a shared-memory segment (kind "shm") or one CUDA IPC-exported device
  buffer (kind "cuda");
- generations: a small shared-memory table of int64, one per block, holding
  the generation of the allocation that last took the block. It is updated
  *before* new bytes are written, so a reader that checks it after copying
  knows whether what it copied is still the entry its handle names.
"""

from __future__ import annotations

import uuid

import numpy as np
import torch

from pipeline.arena import cuda_ipc
from pipeline.arena.dtypes import dtype_name
from pipeline.arena.index import EmbeddingIndex, Entry
from pipeline.arena.shm import ShmSegment, remove_stale_segments, segment_name
from pipeline.protocol import ArenaHandle, ArenaInfo


class ArenaStore:
    def __init__(self, capacity: int, block_bytes: int, device: torch.device, instance: str,
                 lease_timeout: float = 30.0) -> None:
        if block_bytes < 256 or block_bytes % 256:
            raise ValueError(f"block_bytes must be a positive multiple of 256, got {block_bytes}")
        num_blocks = capacity // block_bytes
        if num_blocks < 1:
            raise ValueError(f"arena capacity {capacity} is smaller than one block ({block_bytes})")
        remove_stale_segments(instance)  # what an earlier, crashed incarnation left
        self.arena_id = f"{instance}-{uuid.uuid4().hex[:8]}"
        self.device = device
        self.index = EmbeddingIndex(num_blocks, block_bytes, lease_timeout, lease_prefix=self.arena_id + ":")
        self._generations_shm = ShmSegment.create(segment_name(instance, "gen"), num_blocks * 8)
        self.generations = np.frombuffer(self._generations_shm.mmap, dtype=np.int64)
        self._data_shm: ShmSegment | None = None
        cuda_handle = b""
        if device.type == "cuda":
            self.data = cuda_ipc.allocate(num_blocks * block_bytes, device)
            cuda_handle = cuda_ipc.export(self.data)
        else:
            self._data_shm = ShmSegment.create(segment_name(instance, "data"), num_blocks * block_bytes)
            self.data = torch.frombuffer(self._data_shm.mmap, dtype=torch.uint8)
        self.info = ArenaInfo(
            arena_id=self.arena_id, kind="cuda" if device.type == "cuda" else "shm",
            capacity=num_blocks * block_bytes, block_bytes=block_bytes,
            generations_name=self._generations_shm.name,
            data_name=self._data_shm.name if self._data_shm else "",
            device=device.index if device.type == "cuda" else -1, cuda_handle=cuda_handle)

    def reserve(self, content_hash: str, shape: tuple[int, ...], dtype: torch.dtype) -> Entry:
        """Room for an embedding; raises ArenaFull. The blocks' generation is
        published now, before any byte of the new entry is written."""
        nbytes = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
        entry = self.index.reserve(content_hash, nbytes, tuple(shape), dtype_name(dtype))
        self.generations[entry.start_block:entry.start_block + entry.num_blocks] = entry.generation
        return entry

    def write(self, entry: Entry, tensor: torch.Tensor) -> None:
        """Copy `tensor` into the entry's blocks (asynchronously on CUDA: call
        `sync()` before announcing)."""
        flat = tensor.detach().contiguous().view(-1).view(torch.uint8)
        if flat.numel() != entry.nbytes:
            raise ValueError(f"tensor has {flat.numel()} bytes, entry {entry.nbytes}")
        offset = entry.start_block * self.index.block_bytes
        self.data[offset:offset + entry.nbytes].copy_(flat, non_blocking=True)

    def write_rows(self, entry: Entry, tensor: torch.Tensor, first_row: int) -> None:
        """Copy `tensor` into the entry's rows from `first_row` on (a part of
        an embedding computed in several forwards); as `write` otherwise."""
        flat = tensor.detach().contiguous().view(-1).view(torch.uint8)
        row_bytes = entry.nbytes // entry.shape[0]
        start = first_row * row_bytes
        if flat.numel() % row_bytes or start + flat.numel() > entry.nbytes:
            raise ValueError(f"{flat.numel()} bytes from row {first_row} do not fit entry of {entry.nbytes}")
        offset = entry.start_block * self.index.block_bytes + start
        self.data[offset:offset + flat.numel()].copy_(flat, non_blocking=True)

    def sync(self) -> None:
        """Make every write so far visible to other processes. Called once per
        batch, before its handles are sent: the message then is the ordering."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def handle(self, entry: Entry) -> ArenaHandle:
        return ArenaHandle(self.arena_id, entry.start_block * self.index.block_bytes, entry.nbytes,
                           entry.shape, entry.dtype, entry.generation)

    def close(self) -> None:
        """Unlink the shared segments (views into them must be gone)."""
        self.data = None
        self.generations = None
        for segment in (self._data_shm, self._generations_shm):
            if segment is not None:
                segment.close()
        self._data_shm = self._generations_shm = None
