"""The generator's KV cache flags: --kv-cache-mib N|auto and
--gpu-memory-utilization, parsed, refused in one line, and turned into bytes
(on the CPU, and on a GPU faked through torch.cuda's memory queries)."""

from __future__ import annotations

import pytest
import torch

from pipeline.engine.kv_budget import CUDA_CONTEXT_BYTES, GIB
from pipeline.models.loader import load_model
from stages.generator import kv_cache_bytes, parse_args

ADDRESS = ["--address", "ipc:///tmp/unused.sock"]


@pytest.fixture(scope="module")
def tiny_model(tiny_dir):
    return load_model(tiny_dir).model


def test_kv_cache_mib_defaults_to_auto_at_nine_tenths():
    args = parse_args(ADDRESS)
    assert args.kv_cache_mib == "auto" and args.gpu_memory_utilization == 0.9
    assert parse_args([*ADDRESS, "--kv-cache-mib", "auto"]).kv_cache_mib == "auto"
    assert parse_args([*ADDRESS, "--kv-cache-mib", "512"]).kv_cache_mib == 512
    assert parse_args([*ADDRESS, "--gpu-memory-utilization", "1"]).gpu_memory_utilization == 1.0



def test_dependent_launch_is_the_default_and_can_be_turned_off():
    assert parse_args(ADDRESS).no_dependent_launch is False   # EngineConfig.dependent_launch None: where supported
    assert parse_args([*ADDRESS, "--no-dependent-launch"]).no_dependent_launch is True


@pytest.mark.parametrize("flags", [
    ["--kv-cache-mib", "-1"], ["--kv-cache-mib", "0"], ["--kv-cache-mib", "lots"], ["--kv-cache-mib", "1.5"],
    ["--gpu-memory-utilization", "0"], ["--gpu-memory-utilization", "1.5"],
    ["--gpu-memory-utilization", "most"], ["--gpu-memory-utilization", "nan"],
])
def test_bad_values_exit_2_with_one_line_naming_the_flag(flags, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args([*ADDRESS, *flags])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("stages.generator: error: ")
    assert flags[0] in err and repr(flags[1]) in err


def test_auto_on_the_cpu_keeps_256_mib(tiny_model):
    assert kv_cache_bytes(parse_args(ADDRESS), tiny_model, torch.device("cpu"))[0] == 256 << 20
    assert kv_cache_bytes(parse_args([*ADDRESS, "--kv-cache-mib", "4"]), tiny_model,
                          torch.device("cpu"))[0] == 4 << 20


@pytest.fixture
def fake_h200(monkeypatch):
    """torch.cuda reports a 141 GiB GPU with 2 GiB in our allocator and 100 GiB free."""
    memory = dict(total=141 * GIB, free=100 * GIB, held=2 * GIB)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (memory["free"], memory["total"]))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: memory["held"])
    return memory


def test_auto_on_cuda_sizes_from_the_devices_memory(tiny_model, fake_h200):
    cuda = torch.device("cuda", 0)
    kv, sized_by = kv_cache_bytes(parse_args([*ADDRESS, "--gpu-memory-utilization", "0.5"]), tiny_model, cuda)
    # The tiny model's reserve is the 1 GiB floor; half of 141 GiB is under the 100 GiB free.
    assert kv == int(0.5 * 141 * GIB) - 2 * GIB - CUDA_CONTEXT_BYTES - 1 * GIB
    assert "0.5 of 141.0 GiB" in sized_by
    # At 0.9 the share (124.4 GiB after weights) is more than is free: free less the reserve.
    assert kv_cache_bytes(parse_args(ADDRESS), tiny_model, cuda)[0] == 99 * GIB


def test_auto_on_cuda_reserves_the_vision_forward_in_aggregated_mode(tiny_model, fake_h200):
    cuda = torch.device("cuda", 0)
    flags = [*ADDRESS, "--max-num-batched-tokens", "65536", "--local-encode-tokens", "262144"]
    epd = kv_cache_bytes(parse_args(flags), tiny_model, cuda)[0]
    aggregated = kv_cache_bytes(parse_args([*flags, "--mode", "aggregated"]), tiny_model, cuda)[0]
    assert epd > aggregated
    # An EPD generator that may encode for itself keeps the same room for it.
    assert kv_cache_bytes(parse_args([*flags, "--encode-fallback", "local"]), tiny_model, cuda)[0] == aggregated


def test_encode_fallback_is_for_epd_generators(capsys):
    assert parse_args(ADDRESS).encode_fallback == "off"
    assert parse_args([*ADDRESS, "--encode-fallback", "local"]).encode_fallback == "local"
    with pytest.raises(SystemExit):
        parse_args([*ADDRESS, "--mode", "aggregated", "--encode-fallback", "local"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--encode-fallback is for --mode epd" in err


def test_auto_on_a_full_gpu_is_a_value_error_naming_the_flags(tiny_model, fake_h200):
    fake_h200["free"] = GIB   # all of it the reserve: no room for one step's KV
    with pytest.raises(ValueError, match="--gpu-memory-utilization"):
        kv_cache_bytes(parse_args(ADDRESS), tiny_model, torch.device("cuda", 0))

