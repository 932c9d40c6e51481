"""Programmatic dependent launch (pipeline/kernels/dependent_launch.py): the
switch and where it is allowed, and, compiled for sm_90 without a GPU
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
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed: the fused decode kernels are CUDA-only extras", allow_module_level=True)
import test_kernels  # noqa: E402,F401  (sets TRITON_INTERPRET=1 before triton loads)
from pipeline.engine.decode_graphs import DEPENDENT_LAUNCH_MAX_BATCH  # noqa: E402
from pipeline.engine.engine import Engine, EngineConfig  # noqa: E402
from pipeline.kernels import dependent_launch  # noqa: E402
from pipeline.processing.processor import MultimodalPrompt  # noqa: E402
from pipeline.sampling_params import SamplingParams  # noqa: E402
from test_engine import tiny  # noqa: E402,F401  (the fixture)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def forbidden_after():
    yield
    dependent_launch.allow(False)


def test_on_only_inside_a_launching_block_and_only_when_allowed():
    assert dependent_launch.launch_options() == {"USE_GDC": False}
    with dependent_launch.launching(True):
        assert not dependent_launch.is_on()   # not allowed yet
    dependent_launch.allow(True)
    assert dependent_launch.launch_options() == {"USE_GDC": False}   # allowed, but outside a block
    with dependent_launch.launching(True):
        assert dependent_launch.launch_options() == {"USE_GDC": True, "launch_pdl": True}
        with dependent_launch.launching(False):
            assert dependent_launch.launch_options() == {"USE_GDC": False}
        assert dependent_launch.is_on()   # restored on the way out
    with pytest.raises(RuntimeError):
        with dependent_launch.launching(True):
            raise RuntimeError("a capture that fails")
    assert not dependent_launch.is_on()
    seen = []
    with dependent_launch.launching(True):   # per thread: another thread launches plainly meanwhile
        other = threading.Thread(target=lambda: seen.append(dependent_launch.launch_options()))
        other.start()
        other.join()
    assert seen == [{"USE_GDC": False}]


def test_configured_on_only_where_supported():
    cpu = torch.device("cpu")
    assert not dependent_launch.supported(cpu)
    dependent_launch.allow(True)
    assert dependent_launch.configure(None, cpu) is False   # the default: on where supported, so off here
    assert dependent_launch.configure(False, cpu) is False
    with pytest.raises(ValueError, match="compute capability 9.0"):
        dependent_launch.configure(True, cpu)
    with dependent_launch.launching(True):
        assert not dependent_launch.is_on()


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
        if where["reads_weight_early"]:   # loads its constant weight first, writes nothing before the wait
            assert where["first_memory"] < where["wait"] < where["first_write"], (name, where)
        else:
            assert where["wait"] < where["first_memory"], (name, where)
        assert where["wait"] < where["release"], (name, where)


def test_the_engine_asks_for_it_only_with_the_fused_kernels(tiny):  # noqa: F811
    model, processor = tiny
    cpu = torch.device("cpu")

    def engine(**config):
        settings = dict(kv_cache_bytes=4 << 20, fast_decode=True, fast_mixed=False, capture_decode_len=0)
        return Engine(model, processor.tokenizer, EngineConfig(**settings, **config), cpu)
    with pytest.raises(ValueError, match="needs the fused decode kernels"):
        engine(dependent_launch=True)   # CPU fast decode without triton's kernels
    with pytest.raises(ValueError, match="compute capability 9.0"):
        engine(decode_matmul="triton", dependent_launch=True)   # the fused kernels, interpreted
    dependent_launch.allow(True)
    engine(decode_matmul="triton")   # the default: forbidden where unsupported
    with dependent_launch.launching(True):
        assert not dependent_launch.is_on()


def test_only_small_decode_batches_launch_dependently(tiny, monkeypatch):  # noqa: F811
    """DecodeGraphs asks for PDL per bucket: up to DEPENDENT_LAUNCH_MAX_BATCH
    rows (measured faster there), not above (measured slower at 32)."""
    model, processor = tiny
    asked: list[bool] = []

    @contextmanager
    def recording(on: bool):
        asked.append(on)
        yield
    monkeypatch.setattr(dependent_launch, "launching", recording)
    engine = Engine(model, processor.tokenizer, EngineConfig(
        max_num_batched_tokens=512, max_num_seqs=16, kv_cache_bytes=4 << 20, fast_decode=True,
        fast_mixed=False, decode_matmul="triton", capture_decode_len=0, decode_ahead=False),
        torch.device("cpu"))
    for batch in (1, DEPENDENT_LAUNCH_MAX_BATCH, DEPENDENT_LAUNCH_MAX_BATCH + 1):
        asked.clear()
        for i in range(batch):
            engine.add_request(f"{batch}-{i}", MultimodalPrompt([5, 6, 7 + i], [], []), [],
                               SamplingParams(max_tokens=3, ignore_eos=True))
        while engine.has_work():
            engine.step()
        assert asked and all(on == (batch <= DEPENDENT_LAUNCH_MAX_BATCH) for on in asked), (batch, asked)
