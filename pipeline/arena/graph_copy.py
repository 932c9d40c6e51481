"""Device-to-device copies by CUDA graph replay: the arena read's hot path.

Each of `slots` graphs holds one launch of the descriptor copy kernel
(pipeline/kernels/arena_copy.py) bound to its own row of a pinned host
table. A copy writes source, destination and size into a free row and
replays that row's graph: one launch, no per-copy tensor views, no kernel
argument packing in Python. Each row has its own event, recorded after its
replay; the row is written again only once that event has completed (the
kernel has read the row by then). Copies may queue behind long work on the
stream (a generator's step), so a row is never assumed free by age alone.

Measured on the 2xH200 box against `Tensor.copy_` with a reused event:
docs/benchmarks.md, issue 3.
"""

from __future__ import annotations

import numpy as np
import torch

from pipeline.kernels import arena_copy


class GraphCopier:
    def __init__(self, device: torch.device, slots: int = 32) -> None:
        self.device = device
        self._table = torch.zeros(slots, arena_copy.DESCRIPTOR_FIELDS, dtype=torch.int64, pin_memory=True)
        self._rows: np.ndarray = self._table.numpy()
        self._events = [torch.cuda.Event() for _ in range(slots)]
        self._in_use = [False] * slots
        self._next = 0
        # Capture after one eager launch (which compiles the kernel), on a
        # side stream as graph capture requires; the zero-size descriptors
        # make both launches no-ops.
        row_bytes = self._table.stride(0) * self._table.element_size()
        self._addresses = [arena_copy.Address(self._table.data_ptr() + i * row_bytes) for i in range(slots)]
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.device(device), torch.cuda.stream(stream):
            arena_copy.copy_by_descriptor(self._addresses[0])
        torch.cuda.current_stream(device).wait_stream(stream)
        self._graphs = []
        pool = None
        for address in self._addresses:
            graph = torch.cuda.CUDAGraph()
            # thread_local: another thread of the stage may use CUDA meanwhile.
            with torch.cuda.device(device), torch.cuda.graph(graph, pool=pool, stream=stream,
                                                             capture_error_mode="thread_local"):
                arena_copy.copy_by_descriptor(address)
            pool = graph.pool()
            self._graphs.append(graph)
        torch.cuda.current_stream(device).synchronize()

    @staticmethod
    def can_copy(src_address: int, nbytes: int, out: torch.Tensor) -> bool:
        return arena_copy.copyable(src_address, nbytes, out) and out.numel() * out.element_size() >= nbytes

    def copy(self, src_address: int, out: torch.Tensor, nbytes: int) -> torch.cuda.Event:
        """Queue the copy of `nbytes` from `src_address` (device-readable)
        into `out` on the current stream. Returns an event that completes
        once the copy has (it is recorded again `slots` copies later, after
        it completed: waiting on it is never too early)."""
        if not self.can_copy(src_address, nbytes, out):
            raise ValueError(f"cannot copy {nbytes} bytes from {src_address:#x} into {tuple(out.shape)}")
        slot = self._next
        self._next = (slot + 1) % len(self._graphs)
        event = self._events[slot]
        if self._in_use[slot] and not event.query():
            event.synchronize()     # `slots` copies still queued: wait for the oldest
        row = self._rows[slot]
        row[arena_copy.SRC] = src_address
        row[arena_copy.DST] = out.data_ptr()
        row[arena_copy.WORDS] = nbytes // arena_copy.WORD
        self._graphs[slot].replay()
        event.record()
        self._in_use[slot] = True
        return event
