"""Vision forwards replayed as CUDA graphs, one per batch shape.

An eager vision forward of the 3B model is ~3,000 PyTorch calls (32 blocks
of norms, projections, rotary, gathers and attention per window size); on
a host that spends tens of microseconds per call, that host work, not the
GPU, sets the encoder's throughput. Everything in a forward depends only on
the pixels and on the images' grids, so for a batch shape (the tuple of
grids) seen before, the forward is one graph replay: the pixels are copied
into the graph's static input and its static output is read back.

Serving sees few shapes when clients send few image sizes, and many when
they do not: a shape is captured only once it has come `capture_after`
times, and at most `max_graphs` are kept (least recently used go first).
Every graph draws on one memory pool; a replay's outputs are valid until
the next replay, so the caller copies them out first (the encoder writes
them into its arena right away).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass

import torch

from pipeline.cuda_graphs import capture_graph

log = logging.getLogger("epd.vision")

Shape = tuple[tuple[int, int, int], ...]
SEEN_LIMIT = 4096


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    pixels: torch.Tensor          # static input
    output: torch.Tensor          # static output, [units of all images, width]
    plan: object                  # the TowerPlan whose device tensors the graph reads: kept alive with it


class VisionGraphs:
    def __init__(self, tower: torch.nn.Module, device: torch.device, max_graphs: int = 16,
                 capture_after: int = 2) -> None:
        if device.type != "cuda":
            raise ValueError(f"vision graphs need a CUDA device, not {device}")
        self.tower, self.device = tower, device
        self.max_graphs, self.capture_after = max_graphs, capture_after
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: OrderedDict[Shape, _Captured] = OrderedDict()
        self.seen: Counter[Shape] = Counter()
        self.replays = 0

    @torch.inference_mode()
    def __call__(self, pixels: torch.Tensor, grids) -> list[torch.Tensor]:
        """The tower's forward: one [tokens_i, width] per image."""
        shape: Shape = tuple(tuple(int(x) for x in g) for g in grids)
        captured = self.graphs.get(shape)
        if captured is None:
            if len(self.seen) > SEEN_LIMIT:   # many one-off shapes: forget them rather than grow
                self.seen.clear()
            self.seen[shape] += 1
            if self.seen[shape] < self.capture_after:
                return self.tower(pixels, list(shape))
            captured = self._capture(shape, pixels)
        else:
            self.graphs.move_to_end(shape)
        captured.pixels.copy_(pixels, non_blocking=True)
        captured.graph.replay()
        self.replays += 1
        return list(captured.output.split(captured.plan.units_per_image))

    def _capture(self, shape: Shape, pixels: torch.Tensor) -> _Captured:
        while len(self.graphs) >= self.max_graphs:
            self.graphs.popitem(last=False)
        started = time.monotonic()
        plan = self.tower.plan(list(shape), self.device)
        static = pixels.to(self.device).clone()
        # The caller may be a worker thread, whose current device is not ours.
        with torch.cuda.device(self.device):
            graph, output = capture_graph(self.device, self.pool, lambda: self.tower.embed_planned(static, plan),
                                          error_mode="thread_local")
        captured = _Captured(graph, static, output, plan)
        self.graphs[shape] = captured
        self.seen.pop(shape, None)
        log.info("captured a vision graph for %d image(s), %d patches, in %.2f s (%d kept)",
                 len(shape), static.shape[0], time.monotonic() - started, len(self.graphs))
        return captured


def vision_forward(tower: torch.nn.Module, device: torch.device, max_graphs: int):
    """The tower itself, or VisionGraphs over it where asked for and possible."""
    if max_graphs == 0:
        return tower
    if device.type != "cuda":
        log.warning("vision graphs need a CUDA device; %s runs vision forwards eagerly", device)
        return tower
    return VisionGraphs(tower, device, max_graphs)
