"""bin/epd-generate as a user runs it: output formats, the built-in model,
and one-line errors with a non-zero exit."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, random_image

CLI = [sys.executable, str(REPO / "bin" / "epd-generate")]


def run(args, env=None, timeout=120):
    return subprocess.run(CLI + args, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def assert_one_line_error(result, *fragments):
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("epd-generate: error: ")
    for fragment in fragments:
        assert fragment in lines[0]


def test_builtin_model_is_written_on_first_use_and_matches_the_fixture(tiny_dir, tmp_path):
    image = tmp_path / "cat.png"
    random_image(64, 96).save(image)
    args = ["--prompt", "What is this?", "--image", str(image), "--max-tokens", "8", "--json", "--ignore-eos"]
    builtin = run(args, env={"EPD_CACHE_DIR": str(tmp_path / "cache")})
    assert builtin.returncode == 0, builtin.stderr
    assert list((tmp_path / "cache").iterdir())[0].name.startswith("tiny-qwen2.5-vl-v")
    explicit = run(args + ["--model", str(tiny_dir)])
    got, expected = (json.loads(r.stdout.splitlines()[-1]) for r in (builtin, explicit))
    assert got == expected
    assert len(got["token_ids"]) == 8


def test_plain_output_is_the_text(tiny_dir):
    as_json = run(["--model", str(tiny_dir), "--prompt", "hello", "--max-tokens", "6", "--json"])
    plain = run(["--model", str(tiny_dir), "--prompt", "hello", "--max-tokens", "6"])
    assert plain.returncode == 0
    assert plain.stdout.rstrip("\n") == json.loads(as_json.stdout.splitlines()[-1])["text"]


def test_missing_model_folder(tmp_path):
    assert_one_line_error(run(["--model", str(tmp_path / "absent"), "--prompt", "x"]),
                          "model folder not found")


def test_unsupported_architecture(tiny_dir, tmp_path):
    import shutil

    other = tmp_path / "llama"
    shutil.copytree(tiny_dir, other)
    config = json.loads((other / "config.json").read_text())
    config.update(model_type="llama", architectures=["LlamaForCausalLM"])
    (other / "config.json").write_text(json.dumps(config))
    assert_one_line_error(run(["--model", str(other), "--prompt", "x"]), "unsupported architecture", "llama")


@pytest.mark.parametrize("content,fragment", [
    (None, "cannot read image"),
    (b"", "image"),
    (b"this is not an image at all", "image"),
    ("truncated", "image"),
])
def test_unreadable_or_corrupt_image(tiny_dir, tmp_path, content, fragment):
    path = tmp_path / "bad.jpg"
    if content == "truncated":
        random_image(200, 200).save(path, format="JPEG")
        path.write_bytes(path.read_bytes()[:600])
    elif content is not None:
        path.write_bytes(content)
    result = run(["--model", str(tiny_dir), "--prompt", "x", "--image", str(path)])
    assert_one_line_error(result, fragment)


def test_prompt_longer_than_context(tiny_dir):
    context = json.loads((tiny_dir / "config.json").read_text())["max_position_embeddings"]
    result = run(["--model", str(tiny_dir), "--prompt", "word " * context, "--max-tokens", "4"])
    assert_one_line_error(result, f"context of {context} tokens")


def test_max_tokens_must_be_positive(tiny_dir):
    result = run(["--model", str(tiny_dir), "--prompt", "x", "--max-tokens", "0"])
    assert_one_line_error(result, "--max-tokens must be at least 1")


@pytest.mark.parametrize("program, args, fragment", [
    ("stages.encoder", ["--address", "ipc:///tmp/unused", "--arena-mib", "lots"], "--arena-mib"),
    ("stages.encoder", ["--address", "ipc:///tmp/unused", "--arena-mib", "0"], "--arena-mib must be at least 1"),
    ("stages.proxy", ["--bogus"], "--bogus"),
    ("stages.proxy", ["--generators", "ipc:///tmp/unused", "--mode", "aggregated", "--stage-timeout", "0.1"],
     "--stage-timeout must be more than 0.5 seconds"),
    ("stages.generator", ["--address", "ipc:///tmp/unused", "--mode", "both"], "--mode"),
    ("stages.generator", ["--address", "ipc:///tmp/unused", "--cpu-threads", "0"], "--cpu-threads"),
    ("stages.proxy", ["--generators", "ipc:///tmp/unused", "--mode", "aggregated", "--drain-timeout", "-1"],
     "--drain-timeout must be >= 0 seconds"),
    ("stages.encoder", ["--address", "ipc:///tmp/unused", "--cpu-threads", "many"], "--cpu-threads"),
])
def test_stages_refuse_bad_flags_in_one_line(program, args, fragment):
    """A stage started with a bad flag (by hand, or from a unit file) says
    so in one line and exits 2, before loading anything."""
    result = subprocess.run([sys.executable, "-m", program, *args], capture_output=True, text=True,
                            timeout=60, cwd=REPO)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{program}: error: ") and fragment in lines[0], result.stderr


@pytest.mark.parametrize("program", ["stages.encoder", "stages.generator"])
def test_a_taken_address_is_one_line_and_leaves_nothing(program):
    """The inbox is bound before anything is loaded or made: a taken
    address is one line, exit 1, and no shared memory left behind."""
    from pipeline.arena.shm import our_segments

    before = set(our_segments())
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        result = subprocess.run([sys.executable, "-m", program, "--address", address, "--device", "cpu",
                                 "--instance", f"taken-{os.getpid()}"],
                                capture_output=True, text=True, timeout=60, cwd=REPO)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{program}: error: cannot bind {address}: "), result.stderr
    assert not [n for n in set(our_segments()) - before if f"-taken-{os.getpid()}-" in n]


@pytest.mark.parametrize("taken_flag", ["--address", "--port"])
def test_the_proxy_on_a_taken_address_or_port_is_one_line(taken_flag):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        free = {"--address": ["--address", f"tcp://127.0.0.1:{port}", "--port", "1"],
                "--port": ["--address", f"ipc:///tmp/epd-test-proxy-{os.getpid()}.sock", "--host", "127.0.0.1",
                           "--port", str(port)]}[taken_flag]
        result = subprocess.run([sys.executable, "-m", "stages.proxy", *free, "--mode", "aggregated",
                                 "--generators", "ipc:///tmp/nowhere.sock"],
                                capture_output=True, text=True, timeout=60, cwd=REPO)
    Path(f"/tmp/epd-test-proxy-{os.getpid()}.sock").unlink(missing_ok=True)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("stages.proxy: error: cannot "), result.stderr
    assert str(port) in lines[0]
