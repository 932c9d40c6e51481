"""Device-to-device copies by raw pointer, through the CUDA runtime that
PyTorch has already loaded.

Why not `Tensor.copy_`: between two devices it switches devices, records and
waits on events on both streams and checks peer access on every call, tens
of microseconds of host time for a copy whose transfer takes a few. An
arena read is always a plain byte copy between two live allocations, so one
`cudaMemcpyAsync` on the consumer's stream does it; with unified addressing
the runtime routes it (same device, or peer over NVLink).
"""

from __future__ import annotations

import ctypes
import logging
from functools import lru_cache

import torch

log = logging.getLogger("epd.arena")

_MEMCPY_DEFAULT = 4   # cudaMemcpyDefault: direction inferred from the pointers (unified addressing)


class CudaRuntime:
    def __init__(self, lib: ctypes.CDLL) -> None:
        self._memcpy = lib.cudaMemcpyAsync
        self._memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        self._memcpy.restype = ctypes.c_int
        self._error_string = lib.cudaGetErrorString
        self._error_string.restype = ctypes.c_char_p

    def copy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        code = self._memcpy(dst, src, nbytes, _MEMCPY_DEFAULT, stream)
        if code != 0:
            raise RuntimeError(f"cudaMemcpyAsync failed: {self._error_string(code).decode()} ({code})")


@lru_cache(maxsize=1)
def runtime() -> CudaRuntime | None:
    """The CUDA runtime library loaded in this process by PyTorch, or None
    (no CUDA, or a build whose runtime is linked statically)."""
    if not torch.cuda.is_available():
        return None
    torch.cuda.init()
    path = _loaded_library("libcudart.so")
    if path is None:
        log.info("libcudart is not loaded as a shared library: arena reads use Tensor.copy_")
        return None
    return CudaRuntime(ctypes.CDLL(path))


def _loaded_library(prefix: str) -> str | None:
    # The very library PyTorch uses (same context and streams), not another
    # copy found on a search path.
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "/" in path and path.rsplit("/", 1)[-1].startswith(prefix):
                return path
    return None


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Queue dst[:] = src[:] (contiguous byte tensors on CUDA devices) on
    dst's device's current stream."""
    lib = runtime()
    if lib is None:
        dst.copy_(src, non_blocking=True)
        return
    device = dst.device.index
    if torch.cuda.current_device() != device:
        with torch.cuda.device(device):
            lib.copy_async(dst.data_ptr(), src.data_ptr(), src.numel(), torch.cuda.current_stream().cuda_stream)
        return
    lib.copy_async(dst.data_ptr(), src.data_ptr(), src.numel(), torch.cuda.current_stream().cuda_stream)
