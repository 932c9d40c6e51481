"""The generator's KV cache flags: --kv-cache-mib N|auto and
--gpu-memory-utilization, parsed, refused in one line, and turned into bytes
(on the CPU, and on a GPU faked through torch.cuda's memory queries); and
--max-model-len, which the KV cache must hold one request of at start-up."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.engine.kv_budget import CUDA_CONTEXT_BYTES, GIB, check_max_model_len
from pipeline.generator.kv_sizing import check_context, kv_cache_bytes
from pipeline.models.loader import load_model
from stages.generator import parse_args

ADDRESS = ["--address", "ipc:///tmp/unused.sock"]
REPO = Path(__file__).resolve().parents[1]


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



def test_max_model_len_must_fit_the_kv_cache_at_start_up(tiny_model):
    # The tiny model: 3 layers, 2 KV heads of 16, float32: 768 bytes a token;
    # 4 MiB hold 341 blocks of 16, 5456 tokens, under its 8192-token context.
    lang = tiny_model.spec.language
    assert lang.max_context == 8192
    with pytest.raises(ValueError) as exc:
        check_context(parse_args([*ADDRESS, "--kv-cache-mib", "4"]), tiny_model, 4 << 20, "--kv-cache-mib 4")
    text = str(exc.value)
    assert "holds 5456 tokens" in text and "--max-model-len 8192" in text and "at most 5456" in text
    check_context(parse_args([*ADDRESS, "--kv-cache-mib", "4", "--max-model-len", "5456"]), tiny_model, 4 << 20, "")
    with pytest.raises(ValueError, match="holds 5456 tokens"):
        check_context(parse_args([*ADDRESS, "--max-model-len", "5457"]), tiny_model, 4 << 20, "")
    with pytest.raises(ValueError, match="this checkpoint takes 1 to 8192"):
        check_context(parse_args([*ADDRESS, "--max-model-len", "8193"]), tiny_model, 64 << 20, "")


def test_check_max_model_len_counts_whole_blocks():
    check_max_model_len(kv_bytes=10 * 16 * 100, kv_bytes_per_token=100, block_size=16, max_model_len=160, sized_by="")
    with pytest.raises(ValueError, match="holds 144 tokens"):   # 159 tokens' bytes: 9 whole blocks
        check_max_model_len(159 * 100, 100, 16, 145, "")


@pytest.mark.parametrize("value", ["0", "-3"])
def test_a_max_model_len_under_one_exits_2(value, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args([*ADDRESS, "--max-model-len", value])
    assert exit_.value.code == 2 and "--max-model-len must be at least 1" in capsys.readouterr().err


def test_a_generator_whose_kv_cache_is_too_small_exits_1_in_one_line(tmp_path, tiny_dir):
    proc = subprocess.run([sys.executable, "-m", "stages.generator", "--address", f"ipc://{tmp_path}/gen.sock",
                           "--model", str(tiny_dir), "--device", "cpu", "--cpu-threads", "1", "--kv-cache-mib", "2"],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if line.startswith("stages.generator: error:")]
    assert len(lines) == 1 and "lower --max-model-len to at most 2720" in lines[0], proc.stderr[-2000:]


def test_enforce_eager_is_off_by_default_and_refuses_vision_graphs(capsys):
    assert parse_args(ADDRESS).enforce_eager is False
    assert parse_args([*ADDRESS, "--enforce-eager"]).enforce_eager is True
    with pytest.raises(SystemExit) as exit_:
        parse_args([*ADDRESS, "--enforce-eager", "--vision-graphs", "4"])
    assert exit_.value.code == 2 and "--enforce-eager runs no CUDA graphs" in capsys.readouterr().err
