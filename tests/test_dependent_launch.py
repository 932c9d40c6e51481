"""Programmatic dependent launch (pipeline/kernels/dependent_launch.py): the
switch, the gemv's prefetch size, and, compiled for sm_90 without a GPU
(tests/pdl_ptx.py), that every kernel taking USE_GDC waits for the previous
grid before its first global memory access and before it lets the next one
start. That order is what keeps the chain of PDL launches transitive.

Skipped where triton is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed: the fused decode kernels are CUDA-only extras", allow_module_level=True)
if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("triton was imported without its interpreter; run this file alone", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
from pipeline.kernels import dependent_launch  # noqa: E402
from pipeline.kernels.gemv import _prefetch_lines  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def switched_off_after():
    yield
    dependent_launch.enable(False)


def test_off_by_default_and_switches():
    assert dependent_launch.launch_options() == {"USE_GDC": False}
    dependent_launch.enable(True)
    assert dependent_launch.launch_options() == {"USE_GDC": True, "launch_pdl": True}
    assert dependent_launch.prefetching()
    dependent_launch.enable(True, prefetch=False)
    assert dependent_launch.is_on() and not dependent_launch.prefetching()
    dependent_launch.enable(False, prefetch=True)   # no prefetch without the wait it runs before
    assert dependent_launch.launch_options() == {"USE_GDC": False} and not dependent_launch.prefetching()


def test_not_supported_off_the_gpu():
    assert not dependent_launch.supported(torch.device("cpu"))


@pytest.mark.parametrize("block_n, k_per_split, want", [
    (4, 2048, 16),    # qkv, o_proj: 8 KiB a program is 2 KiB of each of 4 rows, 16 lines of 64 bf16
    (64, 2048, 1),    # gate_up: one line of each of 64 rows
    (128, 2048, 0),   # a program wider than the budget prefetches nothing
    (4, 100, 2),      # a short K: its 2 lines, not 16
    (4, 130, 2),      # 3 lines rounded down to a power of two
])
def test_prefetch_lines(block_n, k_per_split, want):
    assert _prefetch_lines(block_n, k_per_split, 64) == want


def test_every_pdl_kernel_waits_before_touching_memory():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "pdl_ptx.py")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout)
    # The decode step's kernels, at least: a rename must not drop one silently.
    assert {"rmsnorm._add_rms_norm_kernel", "gemv._gemv_kernel", "rotary_kv._rotary_kv_kernel",
            "decode_attention._split_kernel", "activation._silu_mul_kernel"} <= set(report)
    for name, where in report.items():
        assert "error" not in where, (name, where)
        assert where["launch_pdl"], name
        assert where["wait"] is not None and where["first_memory"] is not None, (name, where)
        assert where["wait"] < where["first_memory"], (name, where)
        assert where["wait"] < where["release"], (name, where)
        if where["prefetch"] is not None:   # only weights, before the wait
            assert name == "gemv._gemv_kernel" and where["prefetch"] < where["wait"], (name, where)
