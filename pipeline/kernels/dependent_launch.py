"""Programmatic dependent launch (PDL) for the fast paths' Triton kernels.

A batch-1 decode step is about 400 kernels, most of them a few microseconds
long, run back to back from one CUDA graph. Between two of them the GPU
drains the first grid, flushes its writes, then launches and schedules the
second: a gap of about a microsecond each time, paid some 400 times a step.
On Hopper and later a kernel launched with PDL may start while its
predecessor is still running; it must execute `griddepcontrol.wait`
(tl.extra.cuda.gdc_wait) before it touches memory the predecessor writes,
and that wait returns once the predecessor has completed and its writes are
visible. What runs before the wait (scheduling, address arithmetic, and in
the gemv an L2 prefetch of its weights, which no kernel writes) overlaps the
predecessor's tail.

Ordering stays transitive only if every kernel launched with PDL waits
before it completes: then kernel n+1 cannot finish before kernel n has, so
a kernel two launches later still sees everything written before it. So
each PDL kernel here waits unconditionally, at its top (`wait_then_release`).

Process-wide and off by default: `enable` is called by the engine from its
config (the choice changes the compiled kernels, so it is made before any
graph is captured), and only where `supported` says the GPU, the Triton
build and the mode (not the CPU interpreter) allow it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pipeline.kernels import interpreting

_state = {"on": False, "prefetch": False}


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


def enable(on: bool, prefetch: bool = True) -> None:
    """Turn PDL on or off for every kernel launched after this call;
    `prefetch`: the gemv also pulls its weight rows into L2 before its wait."""
    _state["on"] = bool(on)
    _state["prefetch"] = bool(on and prefetch)


def is_on() -> bool:
    return _state["on"]


def prefetching() -> bool:
    return _state["prefetch"]


def launch_options() -> dict:
    """Keyword arguments for a kernel launch: the USE_GDC constexpr every
    PDL-aware kernel takes, and Triton's launch_pdl flag when it is on."""
    if _state["on"]:
        return {"USE_GDC": True, "launch_pdl": True}
    return {"USE_GDC": False}


@triton.jit
def wait_then_release(USE_GDC: tl.constexpr):
    """At a kernel's top: wait for the previous grid's writes, then let the
    next kernel's programs start as soon as this grid's are all running."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
