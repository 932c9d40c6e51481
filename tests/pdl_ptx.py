"""Compiles every kernel that takes USE_GDC (pipeline/kernels) for sm_90
with PDL on, without a GPU, and prints, as JSON, where in each one's PTX the
grid-dependency wait, the release and the first global memory access fall.
Run by tests/test_dependent_launch.py in a subprocess: the other kernel
tests import triton with its interpreter on, and interpreted kernels cannot
be compiled.

A kernel found with USE_GDC but missing from SPECS is reported as such, so
a new PDL kernel cannot skip the check. "name:variant" entries compile the
same kernel again with other constexprs.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import pipeline.kernels

# Constexpr values per kernel: 3B decode shapes (any valid ones would do).
SPECS = {
    "rmsnorm._add_rms_norm_kernel": dict(HAS_DELTA=True, BLOCK=2048),
    "activation._silu_mul_kernel": dict(BLOCK=1024),
    "rotary_kv._rotary_kv_kernel": dict(HEADS=16, KV_HEADS=2, HEAD_DIM=128, HALF=64, BLOCK_H=32,
                                        BLOCK_HALF=64, BLOCK_KV=2, BLOCK_D=128),
    "decode_attention._split_kernel": dict(HEADS=16, KV_HEADS=2, HEAD_DIM=128, PAGE=16, SPLIT_LEN=64,
                                           NUM_SPLITS=4, BLOCK_G=16, BLOCK_D=128, BLOCK_N=32, PRECISION="tf32"),
    "decode_attention._merge_kernel": dict(HEADS=16, HEAD_DIM=128, NUM_SPLITS=4, BLOCK_S=4, BLOCK_D=128),
    "gemv._gemv_kernel": dict(HAS_BIAS=True, MODE=0, SPLIT_K=1, EVEN_K=True, BLOCK_M=1, BLOCK_N=4, BLOCK_K=512,
                              PRECISION="tf32", UPCAST_DOT=False, NUM_STAGES=4, GATED=False, PRELOAD=False,
                              BLOCK_KP=1),
    # The gated MLP's epilogue (gemv_silu_mul), at gate_up's config.
    "gemv._gemv_kernel:gated": dict(HAS_BIAS=False, MODE=2, SPLIT_K=1, EVEN_K=True, BLOCK_M=16, BLOCK_N=64,
                                    BLOCK_K=128, PRECISION="tf32", UPCAST_DOT=False, NUM_STAGES=4, GATED=True,
                                    PRELOAD=False, BLOCK_KP=1),
    # One row's weight slice read before the wait (GemvConfig.preload).
    "gemv._gemv_kernel:preload": dict(HAS_BIAS=False, MODE=0, SPLIT_K=1, EVEN_K=True, BLOCK_M=1, BLOCK_N=4,
                                      BLOCK_K=512, PRECISION="tf32", UPCAST_DOT=False, NUM_STAGES=4, GATED=False,
                                      PRELOAD=True, BLOCK_KP=2048),
    "gemv._split_sum_kernel": dict(HAS_BIAS=True, SPLIT_K=2, BLOCK=1024),
    # The q/k/v projection with rotary and the K/V write, at qkv's batch-1 config.
    "gemv_rotary._gemv_rotary_kv_kernel": dict(HAS_BIAS=True, MODE=0, EVEN_K=True, BLOCK_M=1, BLOCK_N=4,
                                               BLOCK_K=512, PRECISION="tf32", UPCAST_DOT=False, NUM_STAGES=4,
                                               HEADS=16, KV_HEADS=2, HEAD_DIM=128, HALF=64, PAIRS=2,
                                               PRELOAD=False, BLOCK_KP=1),
    "gemv_rotary._gemv_rotary_kv_kernel:preload": dict(HAS_BIAS=True, MODE=0, EVEN_K=True, BLOCK_M=1, BLOCK_N=4,
                                                       BLOCK_K=512, PRECISION="tf32", UPCAST_DOT=False,
                                                       NUM_STAGES=4, HEADS=16, KV_HEADS=2, HEAD_DIM=128, HALF=64,
                                                       PAIRS=2, PRELOAD=True, BLOCK_KP=2048),
}
# Variants that read their (constant) weight before the wait: they may load,
# never store, before it.
READ_WEIGHT_EARLY = {name for name in SPECS if name.endswith(":preload")}
FLOAT_ARGS = {"eps", "scale"}
FLOAT32_POINTERS = {"part_ptr", "acc_ptr", "stats_ptr"}
INT_POINTERS = {"slots_ptr", "tables_ptr", "lengths_ptr"}


def pdl_kernels() -> dict:
    found = {}
    for info in pkgutil.iter_modules(pipeline.kernels.__path__):
        module = importlib.import_module(f"pipeline.kernels.{info.name}")
        for name, obj in vars(module).items():
            if isinstance(obj, triton.runtime.JITFunction) and obj.__module__ == module.__name__ \
                    and any(p.name == "USE_GDC" for p in obj.params) and name.startswith("_"):
                found[f"{info.name}.{name}"] = obj
    return found


def signature(fn, constexprs: dict) -> dict:
    sig = {}
    for p in fn.params:
        if p.is_constexpr:
            sig[p.name] = "constexpr"
        elif p.name in FLOAT_ARGS:
            sig[p.name] = "fp32"
        elif p.name.endswith("_ptr"):
            sig[p.name] = "*fp32" if p.name in FLOAT32_POINTERS else "*i32" if p.name in INT_POINTERS else "*bf16"
        else:
            sig[p.name] = "i32"
    missing = [p.name for p in fn.params if p.is_constexpr and p.name not in constexprs]
    if missing:
        raise KeyError(f"constexprs without a value: {missing}")
    return sig


def where(ptx: list[str], pattern: str) -> int | None:
    return next((i for i, line in enumerate(ptx) if pattern in line), None)


def main() -> int:
    report = {}
    for kernel_name, fn in pdl_kernels().items():
        if kernel_name not in SPECS:
            report[kernel_name] = {"error": "no entry in tests/pdl_ptx.py SPECS"}
        for name in [key for key in SPECS if key.split(":")[0] == kernel_name]:
            report[name] = dict(compiled(fn, SPECS[name]), reads_weight_early=name in READ_WEIGHT_EARLY)
    json.dump(report, sys.stdout)
    return 0


def compiled(fn, spec: dict) -> dict:
    """Where the wait, the release and the first memory access fall in fn's PTX."""
    constexprs = dict(spec, USE_GDC=True)
    kernel = triton.compile(ASTSource(fn, signature(fn, constexprs), constexprs),
                            target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": 4, "launch_pdl": True})
    ptx = kernel.asm["ptx"].splitlines()
    first_memory = next((i for i, line in enumerate(ptx) if re.search(r"\b(ld\.global|st\.global|cp\.async|"
                                                                      r"atom\.|red\.global)", line)), None)
    first_write = next((i for i, line in enumerate(ptx) if re.search(r"\b(st\.global|atom\.|red\.global)", line)),
                       None)
    return {"wait": where(ptx, "griddepcontrol.wait"),
            "release": where(ptx, "griddepcontrol.launch_dependents"),
            "first_memory": first_memory, "first_write": first_write,
            "launch_pdl": bool(kernel.metadata.launch_pdl)}


if __name__ == "__main__":
    sys.exit(main())
