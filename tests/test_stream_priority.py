"""The generator's --stream-priority: parsed, refused where other threads
make the engine's GPU tensors, and a no-op off CUDA."""

from __future__ import annotations

import pytest
import torch

from pipeline.stream_priority import use_stream_priority
from stages.generator import parse_args

ADDRESS = ["--address", "ipc:///tmp/unused.sock"]


def test_default_is_normal_and_high_parses_for_epd():
    assert parse_args(ADDRESS).stream_priority == "normal"
    assert parse_args([*ADDRESS, "--stream-priority", "high"]).stream_priority == "high"


@pytest.mark.parametrize("flags", [["--mode", "aggregated"], ["--encode-fallback", "local"]])
def test_high_is_refused_where_worker_threads_make_gpu_tensors(flags, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args([*ADDRESS, "--stream-priority", "high", *flags])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--stream-priority high is for --mode epd" in err


def test_off_cuda_the_current_stream_is_left_alone():
    assert use_stream_priority(torch.device("cpu"), "high") is None
    assert use_stream_priority(torch.device("cpu"), "normal") is None
    with pytest.raises(ValueError, match="want one of"):
        use_stream_priority(torch.device("cpu"), "urgent")
