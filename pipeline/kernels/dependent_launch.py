"""Programmatic dependent launch (PDL) for the fast paths' Triton kernels.

A batch-1 decode step is about 400 kernels, most of them a few microseconds
long, run back to back from one CUDA graph. Between two of them the GPU
drains the first grid, flushes its writes, then launches and schedules the
second: a gap of about a microsecond each time, paid some 400 times a step.
On Hopper and later a kernel launched with PDL may start while its
predecessor is still running; it must execute `griddepcontrol.wait`
(tl.extra.cuda.gdc_wait) before it touches memory the predecessor writes,
and that wait returns once the predecessor has completed and its writes are
visible. What runs before the wait (the launch, scheduling the programs,
address arithmetic) overlaps the predecessor's tail. On an H200 it took the
3B model's captured batch-1 decode step from 2.39 to 2.17 ms, with the same
tokens (docs/benchmarks.md, session 18). Prefetching each gemv's first
weight lines into L2 before its wait was measured too: no further gain.

Ordering stays transitive only if every kernel launched with PDL waits
before it completes: then kernel n+1 cannot finish before kernel n has, so
a kernel two launches later still sees everything written before it. So
each PDL kernel here waits unconditionally, at its top (`wait_then_release`).
Most release their successor right after that wait; a kernel followed by
another heavy one releases late (`wait_only`, then `release_dependents`
after its main loop), or the successor's waiting programs take SM slots
its own later programs need: the gated gemv released early measured 17.6%
slower at batch 1 (docs/benchmarks.md, session 23).

Where: the decode graphs of small batches (`launching`, around their
capture), where a step is hundreds of kernels of a few microseconds. From
16 rows (cuBLAS projections, longer kernels) the same launches measured
0.4-3.2% slower, so larger decode batches, mixed steps and the vision
tower launch plainly.

The permission is process-wide, off until `configure` (the engine, from its
config) allows it, and only where `supported` says the GPU, the Triton
build and the mode (not the CPU interpreter) can: the choice changes the
compiled kernels, so it is made before any graph is captured. Whether a
`launching` block is open is per thread: a vision forward on another
thread launches plainly meanwhile.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch
import triton
import triton.language as tl

from pipeline.kernels import interpreting

_allowed = {"value": False}
_block = threading.local()   # .on: inside a launching(True) block, where allowed


def supported(device: torch.device) -> bool:
    """Compute capability 9.0 or later, a Triton that can launch with PDL,
    and compiled kernels (the interpreter has no grids to overlap)."""
    if device.type != "cuda" or interpreting():
        return False
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra.cuda import gdc_wait  # noqa: F401
    except ImportError:
        return False
    if "launch_pdl" not in getattr(CUDAOptions, "__dataclass_fields__", {}):
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def allow(on: bool) -> None:
    """Permit (or forbid) PDL launches inside `launching` blocks, with no
    check of the device: configure's effect, for tests and benchmarks."""
    _allowed["value"] = bool(on)


def configure(wanted: bool | None, device: torch.device) -> bool:
    """The engine's choice: None is allowed wherever supported; True where
    it is not is an error. Returns whether it is allowed."""
    if wanted and not supported(device):
        raise ValueError(f"dependent launch needs a GPU of compute capability 9.0 or later and a Triton "
                         f"that launches with PDL; not available on {device}")
    allow(supported(device) if wanted is None else wanted)
    return _allowed["value"]


@contextmanager
def launching(on: bool):
    """The PDL-aware kernels launched inside this block use PDL if `on` and
    it is allowed; outside every block they launch plainly."""
    before = is_on()
    _block.on = on and _allowed["value"]
    try:
        yield
    finally:
        _block.on = before


def is_on() -> bool:
    return getattr(_block, "on", False)


def launch_options() -> dict:
    """Keyword arguments for a kernel launch: the USE_GDC constexpr every
    PDL-aware kernel takes, and Triton's launch_pdl flag when it is on."""
    if is_on():
        return {"USE_GDC": True, "launch_pdl": True}
    return {"USE_GDC": False}


@triton.jit
def wait_then_release(USE_GDC: tl.constexpr):
    """At a kernel's top: wait for the previous grid's writes, then let the
    next kernel's programs start as soon as this grid's are all running."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait_only(USE_GDC: tl.constexpr):
    """wait_then_release's first half, for a kernel that releases later
    (release_dependents): its successor's programs, waiting, would hold SM
    slots that this grid's later programs need."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()


@triton.jit
def release_dependents(USE_GDC: tl.constexpr):
    if USE_GDC:
        tl.extra.cuda.gdc_launch_dependents()
