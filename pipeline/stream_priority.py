"""A generator's CUDA work on a high-priority stream (--stream-priority high).

Under MPS an encoder beside a generator launches its kernels at CUDA's
default stream priority, the lowest. With the engine thread's current stream
at the highest priority, the GPU's block scheduler is meant to dispatch a
decode step's blocks ahead of the encoder's waiting ones as SMs free up (it
never preempts running blocks). Every GPU operation the engine thread makes
follows the current stream: its kernels, CUDA graph replays, arena copies and
events.

Only the engine thread's stream changes. Another thread's GPU work would no
longer be ordered before the engine's by sharing the default stream, so the
generator allows it only where no other thread makes GPU tensors for the
engine (EPD mode without --encode-fallback local).
"""

from __future__ import annotations

import torch

STREAM_PRIORITIES = ("normal", "high")


def use_stream_priority(device: torch.device, priority: str) -> int | None:
    """Make the calling thread's current stream on `device` one of `priority`;
    returns the CUDA priority it got (lower is higher), None where unchanged."""
    if priority not in STREAM_PRIORITIES:
        raise ValueError(f"stream priority {priority!r}: want one of {STREAM_PRIORITIES}")
    if priority == "normal" or device.type != "cuda":
        return None
    # Out-of-range priorities map to the nearest valid one: this asks for the highest.
    stream = torch.cuda.Stream(device, priority=-(1 << 10))
    torch.cuda.set_stream(stream)
    return stream.priority
