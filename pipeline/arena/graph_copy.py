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

import inspect

import torch

from pipeline.kernels import arena_copy


class GraphCopier:
    # 64 rows: a burst of images handed over between two engine steps rarely
    # finds its row's previous copy still queued.
    def __init__(self, device: torch.device, slots: int = 64) -> None:
        self.device = device
        self.index = device.index
        self._slots = slots
        self._table = torch.zeros(slots, arena_copy.DESCRIPTOR_FIELDS, dtype=torch.int64, pin_memory=True)
        # Written through a flat memoryview: three cell stores take a third
        # of a numpy row assignment's time.
        self._cells = memoryview(self._table.numpy().reshape(-1))
        # Each row's event is recorded by its graph (an event-record node), so
        # a copy makes no record call: on the GPU box `Event.record()` cost
        # 10-13 us of host time, more than the replay. Where this torch cannot
        # capture events, copy() records after the replay instead.
        self._recorded_in_graph = "external" in inspect.signature(torch.cuda.Event.__new__).parameters
        self._events = [torch.cuda.Event(external=True) if self._recorded_in_graph else torch.cuda.Event()
                        for _ in range(slots)]
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
        for address, event in zip(self._addresses, self._events):
            graph = torch.cuda.CUDAGraph()
            # thread_local: another thread of the stage may use CUDA meanwhile.
            with torch.cuda.device(device), torch.cuda.graph(graph, pool=pool, stream=stream,
                                                             capture_error_mode="thread_local"):
                arena_copy.copy_by_descriptor(address)
                if self._recorded_in_graph:
                    event.record()
            pool = graph.pool()
            self._graphs.append(graph)
        torch.cuda.current_stream(device).synchronize()

    @staticmethod
    def accepts(nbytes: int, out: torch.Tensor) -> bool:
        """Whether `out` can take a copy of `nbytes` (whole words, aligned).
        Sources must be word-aligned too: arena offsets are block-aligned."""
        return nbytes % arena_copy.WORD == 0 and out.data_ptr() % arena_copy.WORD == 0 and out.is_contiguous()

    def copy(self, src_address: int, dst_address: int, nbytes: int) -> torch.cuda.Event:
        """Queue the copy of `nbytes` (whole words) from `src_address` to
        `dst_address`, both device-readable and word-aligned (the caller
        checked: see `accepts`), on the current stream of our device.
        Returns an event that completes once the copy has (it is recorded
        again `slots` copies later, after it completed: waiting on it is
        never too early, at worst later than needed)."""
        slot = self.take_row()
        self.describe(slot, src_address, dst_address, nbytes)
        return self.launch(slot)

    # The three steps of copy(), apart so scripts/gpu_handoff_micro.py can time each.

    def take_row(self) -> int:
        slot = self._next
        self._next = slot + 1 if slot + 1 < self._slots else 0
        if self._in_use[slot]:
            event = self._events[slot]
            if not event.query():
                event.synchronize()     # `slots` copies still queued: wait for the oldest
        else:
            self._in_use[slot] = True
        return slot

    def describe(self, slot: int, src_address: int, dst_address: int, nbytes: int) -> None:
        cell = slot * arena_copy.DESCRIPTOR_FIELDS
        self._cells[cell + arena_copy.SRC] = src_address
        self._cells[cell + arena_copy.DST] = dst_address
        self._cells[cell + arena_copy.WORDS] = nbytes // arena_copy.WORD

    def launch(self, slot: int) -> torch.cuda.Event:
        self._graphs[slot].replay()
        event = self._events[slot]
        if not self._recorded_in_graph:
            event.record(torch.cuda.current_stream(self.device))
        return event
