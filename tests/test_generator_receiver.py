"""A generator whose receiver thread is gone hears nothing (no requests, no
stats asks) while its process still looks alive. It must stop instead, with
a failing exit, so that its supervisor restarts it (stages/generator.py)."""

from __future__ import annotations

import logging

import pytest

import stages.generator as generator


@pytest.fixture
def quiet_main(monkeypatch):
    """main() without its process-wide set-up: no root-logger takeover (so
    caplog sees the lines), no signal handlers left behind in pytest."""
    monkeypatch.setattr(generator, "setup_logging", lambda *a: None)
    monkeypatch.setattr(generator.signal, "signal", lambda *a: None)


def run_main(tmp_path, tiny_dir) -> int:
    return generator.main(["--address", f"ipc://{tmp_path}/gen.sock", "--model", str(tiny_dir), "--device", "cpu",
                           "--kv-cache-mib", "8", "--cpu-threads", "1"])


def test_a_receiver_that_raises_stops_the_generator_with_a_failing_exit(tmp_path, tiny_dir, monkeypatch,
                                                                         quiet_main, caplog):
    def broken(*args):
        raise RuntimeError("the receiver broke")
    monkeypatch.setattr(generator, "receive", broken)
    with caplog.at_level(logging.ERROR):
        assert run_main(tmp_path, tiny_dir) == 1
    assert "the receiver thread failed" in caplog.text and "the receiver broke" in caplog.text
    assert "stopping this generator" in caplog.text


def test_a_receiver_that_returns_early_stops_it_too(tmp_path, tiny_dir, monkeypatch, quiet_main, caplog):
    monkeypatch.setattr(generator, "receive", lambda *args: None)
    with caplog.at_level(logging.ERROR):
        assert run_main(tmp_path, tiny_dir) == 1
    assert "the receiver thread ended; stopping this generator" in caplog.text
