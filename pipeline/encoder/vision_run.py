"""The compute thread's side of a batch: the wait for a generator's prefill
(where the encoder yields to it), one vision forward, or a long clip's
forwards in parts, the outputs written into the arena, and one
synchronisation before any handle is announced."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pipeline.arena.index import Entry
from pipeline.arena.store import ArenaStore
from pipeline.encoder.batching import temporal_parts
from pipeline.media.base import DecodedImage
from pipeline.prefill_signal import PrefillHold


@dataclass(frozen=True)
class Decoded:
    """An image or clip decoded and preprocessed, waiting for a forward."""
    content_hash: str
    image: DecodedImage
    tokens: int


class VisionRun:
    def __init__(self, store: ArenaStore, forward: Callable[[torch.Tensor, list], list[torch.Tensor]],
                 max_batch_tokens: int, prefill_hold: PrefillHold | None = None) -> None:
        self.store = store
        self.forward = forward
        self.max_batch_tokens = max_batch_tokens
        self.prefill_hold = prefill_hold   # one image a forward, each held while a generator prefills
        self.forwards = 0   # since start; a clip in parts counts each part

    def __call__(self, reserved: list[tuple[Decoded, Entry]]) -> float:
        """Runs the batch; returns the seconds it was held for a generator's prefill."""
        held = self.prefill_hold.wait() if self.prefill_hold else 0.0
        device = self.store.data.device
        if len(reserved) == 1 and reserved[0][0].tokens > self.max_batch_tokens:
            self._forward_in_parts(*reserved[0], device)
            return held
        pixels = torch.cat([item.image.pixel_values.to(device, non_blocking=True) for item, _ in reserved])
        with torch.inference_mode():
            outputs = self.forward(pixels, [item.image.grid for item, _ in reserved])
            for (_, entry), output in zip(reserved, outputs):
                self.store.write(entry, output)
        self.store.sync()   # also, with a prefill hold, what keeps one forward on the device at a time
        self.forwards += 1
        return held

    def _forward_in_parts(self, item: Decoded, entry: Entry, device: torch.device) -> None:
        """A clip over the token budget: forwards of whole temporal patches
        under the budget, each written into its rows of the one entry, so
        the tower's activations stay bounded however long the clip."""
        grid_t, grid_h, grid_w = item.image.grid
        rows_per_step = grid_h * grid_w   # patch rows of one temporal patch
        tokens_per_step = item.tokens // grid_t
        with torch.inference_mode():
            for start, end in temporal_parts(grid_t, item.tokens, self.max_batch_tokens):
                pixels = item.image.pixel_values[start * rows_per_step:end * rows_per_step]
                output, = self.forward(pixels.to(device, non_blocking=True), [(end - start, grid_h, grid_w)])
                self.store.write_rows(entry, output, start * tokens_per_step)
                self.forwards += 1
        self.store.sync()
