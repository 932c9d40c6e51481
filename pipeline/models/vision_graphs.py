"""Vision forwards replayed as CUDA graphs.

An eager vision forward of the 3B model is ~3,000 PyTorch calls (32 blocks
of norms, projections, rotary, gathers and attention per window size); on
a host that spends tens of microseconds per call, that host work, not the
GPU, sets the encoder's throughput. Everything in a forward depends only on
the pixels and on the images' grids, so a forward over a batch shape seen
before is one graph replay: pixels copied into the graph's static input,
its static output read back.

Batches come in every size, so graphs are not kept per batch: a batch is
cut into runs of images of one grid, each run into power-of-two pieces of
at most `max_images` (13 images of one size: 8 + 4 + 1), and each piece is
a graph. One image size then needs at most log2(max_images) + 1 graphs.
Images are independent in the tower (attention stays inside each image),
so the pieces' outputs are the batch's. A shape is captured once it has
come `capture_after` times; until then its images run eagerly, all such
images of a batch in one packed forward; at most
`max_graphs` are kept, least recently used dropped first. All graphs draw
on one memory pool.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from itertools import accumulate
from dataclasses import dataclass

import torch

from pipeline.cuda_graphs import capture_graph

log = logging.getLogger("epd.vision")

Grid = tuple[int, int, int]
Shape = tuple[Grid, int]   # (grid, images)
SEEN_LIMIT = 4096


def plan_pieces(grids: list[Grid], max_images: int) -> list[tuple[Grid, list[int]]]:
    """(grid, image indices) pieces covering every image once: images of one
    grid grouped (in order of first appearance), each group cut into
    power-of-two pieces of at most max_images, largest first."""
    if max_images < 1:
        raise ValueError(f"max_images={max_images}: want >= 1")
    groups: dict[Grid, list[int]] = {}
    for i, grid in enumerate(grids):
        groups.setdefault(grid, []).append(i)
    top = 1 << (max_images.bit_length() - 1)   # largest power of two <= max_images
    pieces = []
    for grid, indices in groups.items():
        at = 0
        while at < len(indices):
            size = min(top, 1 << ((len(indices) - at).bit_length() - 1))
            pieces.append((grid, indices[at:at + size]))
            at += size
    return pieces


def forward_in_pieces(pixels: torch.Tensor, grids, max_images: int, replay, eager) -> list[torch.Tensor]:
    """A packed batch's forward as the forwards of its pieces (plan_pieces):
    replay((grid, n), pixels of those n images) -> n embeddings, copied out
    (a graph's next replay overwrites its outputs), or None where that shape
    has no graph yet. The images of all such pieces then run together
    through eager(pixels, grids), one packed forward: a batch of many
    sizes must not become one eager forward per size."""
    grids = [tuple(int(x) for x in g) for g in grids]
    patches = [t * h * w for t, h, w in grids]
    starts = [0, *accumulate(patches)]

    def rows(indices: list[int]) -> torch.Tensor:
        parts = [pixels[starts[i]:starts[i] + patches[i]] for i in indices]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    outputs: list[torch.Tensor | None] = [None] * len(grids)
    rest: list[int] = []
    for grid, indices in plan_pieces(grids, max_images):
        got = replay((grid, len(indices)), rows(indices))
        if got is None:
            rest.extend(indices)
            continue
        for i, out in zip(indices, got):
            outputs[i] = out.clone()
    if rest:
        rest.sort()
        for i, out in zip(rest, eager(rows(rest), [grids[i] for i in rest])):
            outputs[i] = out
    return outputs


def _powers_of_two_up_to(limit: int) -> list[int]:
    return [1 << i for i in range(limit.bit_length()) if 1 << i <= limit]


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    pixels: torch.Tensor          # static input
    output: torch.Tensor          # static output, [units of all images, width]
    plan: object                  # the TowerPlan whose device tensors the graph reads: kept alive with it


class VisionGraphs:
    def __init__(self, tower: torch.nn.Module, device: torch.device, max_graphs: int = 16,
                 capture_after: int = 2, max_images: int = 16) -> None:
        if device.type != "cuda":
            raise ValueError(f"vision graphs need a CUDA device, not {device}")
        self.tower, self.device = tower, device
        self.max_graphs, self.capture_after, self.max_images = max_graphs, capture_after, max_images
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: OrderedDict[Shape, _Captured] = OrderedDict()
        self.seen: Counter[Shape] = Counter()

    @torch.inference_mode()
    def __call__(self, pixels: torch.Tensor, grids) -> list[torch.Tensor]:
        """The tower's forward: one [tokens_i, width] per image."""
        return forward_in_pieces(pixels, grids, self.max_images, self._replay, self.tower)

    def warm(self, grids: list[Grid]) -> int:
        """Capture, now, every piece shape of these grids (1, 2, 4, ...
        max_images images), so serving never pauses on a first capture;
        returns how many were captured."""
        patch_dim = self.tower.patch_embed.proj.weight[0].numel()
        shapes = [(tuple(g), n) for g in grids for n in _powers_of_two_up_to(self.max_images)]
        if len(shapes) > self.max_graphs:
            raise ValueError(f"{len(shapes)} warm-up graphs do not fit max_graphs={self.max_graphs}")
        fresh = [shape for shape in shapes if shape not in self.graphs]
        for grid, n in fresh:
            t, h, w = grid
            self._capture((grid, n), torch.zeros(n * t * h * w, patch_dim, device=self.device))
        return len(fresh)

    def _replay(self, shape: Shape, pixels: torch.Tensor) -> list[torch.Tensor] | None:
        """The piece through its graph, captured now if this shape has come
        often enough; None while it has not (it runs eagerly)."""
        captured = self.graphs.get(shape)
        if captured is None:
            if len(self.seen) > SEEN_LIMIT:   # many one-off sizes: forget them rather than grow
                self.seen.clear()
            self.seen[shape] += 1
            if self.seen[shape] < self.capture_after:
                return None
            captured = self._capture(shape, pixels)
        else:
            self.graphs.move_to_end(shape)
        captured.pixels.copy_(pixels, non_blocking=True)
        captured.graph.replay()
        return list(captured.output.split(captured.plan.units_per_image))

    def _capture(self, shape: Shape, pixels: torch.Tensor) -> _Captured:
        while len(self.graphs) >= self.max_graphs:
            self.graphs.popitem(last=False)
        started = time.monotonic()
        plan = self.tower.plan([shape[0]] * shape[1], self.device)
        static = pixels.to(self.device).clone()
        # The caller may be a worker thread, whose current device is not ours.
        with torch.cuda.device(self.device):
            graph, output = capture_graph(self.device, self.pool, lambda: self.tower.embed_planned(static, plan))
        captured = _Captured(graph, static, output, plan)
        self.graphs[shape] = captured
        self.seen.pop(shape, None)
        log.info("captured a vision graph for %d image(s) of grid %s in %.2f s (%d kept)",
                 shape[1], shape[0], time.monotonic() - started, len(self.graphs))
        return captured


def vision_forward(tower: torch.nn.Module, device: torch.device, max_graphs: int,
                   warm_grids: list[Grid] = ()):
    """The tower itself, or VisionGraphs over it where asked for and possible
    (with the piece shapes of `warm_grids` captured up front)."""
    if max_graphs == 0:
        return tower
    if device.type != "cuda":
        log.warning("vision graphs need a CUDA device; %s runs vision forwards eagerly", device)
        return tower
    graphs = VisionGraphs(tower, device, max_graphs)
    if warm_grids:
        started = time.monotonic()
        captured = graphs.warm(list(warm_grids))
        log.info("captured %d vision graphs for grids %s in %.1f s", captured, list(warm_grids),
                 time.monotonic() - started)
    return graphs
