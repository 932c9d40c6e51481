"""The consumer's side of arenas: open each once, copy embeddings out by handle.

A copy is only returned if the blocks still carry the handle's generation
after the copy completed; otherwise the producer reused them (the lease
lapsed) and StaleHandleError says so.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pipeline.arena import cuda_ipc
from pipeline.arena.dtypes import dtype_from_name
from pipeline.arena.shm import ShmSegment
from pipeline.protocol import ArenaHandle, ArenaInfo


class StaleHandleError(Exception):
    """The handle's blocks were reused; its embedding is gone."""


@dataclass
class _Opened:
    info: ArenaInfo
    data: torch.Tensor
    generations: np.ndarray
    segments: list[ShmSegment]


class ArenaReader:
    def __init__(self) -> None:
        self._arenas: dict[str, _Opened] = {}

    def open(self, info: ArenaInfo) -> None:
        """Map an arena (no-op if already open)."""
        if info.arena_id in self._arenas:
            return
        gen_shm = ShmSegment.open(info.generations_name)
        segments = [gen_shm]
        if info.kind == "cuda":
            data = cuda_ipc.open_export(info.cuda_handle)
        elif info.kind == "shm":
            data_shm = ShmSegment.open(info.data_name)
            segments.append(data_shm)
            data = torch.frombuffer(data_shm.mmap, dtype=torch.uint8)
        else:
            gen_shm.close()
            raise ValueError(f"unknown arena kind {info.kind!r}")
        generations = np.frombuffer(gen_shm.mmap, dtype=np.int64)
        self._arenas[info.arena_id] = _Opened(info, data, generations, segments)

    def is_open(self, arena_id: str) -> bool:
        return arena_id in self._arenas

    def read(self, handle: ArenaHandle, device: torch.device | None = None) -> torch.Tensor:
        """A private copy of the embedding, on `device` (default: where the
        arena is). Raises KeyError for an arena never opened."""
        arena = self._arenas[handle.arena_id]
        block = arena.info.block_bytes
        first, last = handle.offset // block, (handle.offset + max(handle.nbytes, 1) - 1) // block
        self._check(arena, handle, first, last)
        source = arena.data[handle.offset:handle.offset + handle.nbytes]
        out = torch.empty(handle.shape, dtype=dtype_from_name(handle.dtype),
                          device=device if device is not None else arena.data.device)
        out.view(-1).view(torch.uint8).copy_(source, non_blocking=True)
        if source.is_cuda or out.is_cuda:
            torch.cuda.current_stream(out.device if out.is_cuda else source.device).synchronize()
        self._check(arena, handle, first, last)
        return out

    @staticmethod
    def _check(arena: _Opened, handle: ArenaHandle, first: int, last: int) -> None:
        gens = arena.generations[first:last + 1]
        if not (gens == handle.generation).all():
            raise StaleHandleError(f"arena {handle.arena_id} blocks {first}-{last} were reused "
                                   f"(generation {handle.generation} expected)")

    def close(self) -> None:
        for arena in self._arenas.values():
            arena.data = None
            arena.generations = None
            for segment in arena.segments:
                segment.close()
        self._arenas.clear()
