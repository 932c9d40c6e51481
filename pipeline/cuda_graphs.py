"""Capturing a forward as a CUDA graph: the one recipe every graph in the
project uses (decode steps, mixed steps, vision forwards)."""

from __future__ import annotations

import torch


def capture_graph(device: torch.device, pool, forward) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Capture `forward()` (static inputs in, one tensor out) as a CUDA graph
    in `pool`, after one warm-up run outside it; returns (graph, output).

    Capture errors are thread-local: a capture mid-serving (a decode bucket
    past the start-up ones, a new image size) must not fail the other
    threads' GPU work meanwhile, such as image decoding with nvJPEG, whose
    allocations a process-wide capture mode would refuse."""
    if device.index is not None and torch.cuda.current_device() != device.index:
        raise RuntimeError(f"CUDA graphs for {device} must be captured with it as the current "
                           "device (torch.cuda.set_device)")
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        forward()  # warm-up outside the graph (lazy inits, autotuning, Triton compiles)
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
        out = forward()
    return graph, out
