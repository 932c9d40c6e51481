"""A launcher killed with SIGKILL (so that it can stop nothing) leaves
nothing behind and loses nothing in flight (pipeline/launcher_watch.py):
the proxy stops listening at once but finishes the stream it holds, the
encoder and the generator serve it to the end and then stop on their own,
and no process, /dev/shm segment or socket file is left. Real stages on
the tiny model, started by bin/epd-launch, their output going to the dead
launcher's pipe."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import openai

from conftest import REPO, image_bytes, random_image
from e2e_helpers import data_url
from stack import free_port
from waiting import until

TOKENS = 3000   # long enough to be mid-stream when the proxy stops listening


def refused(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return False
    except OSError:
        return True


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_killed_launchers_stages_finish_the_stream_in_flight_then_stop_and_leave_nothing(tiny_dir, tmp_path):
    port = free_port()
    env = {**os.environ, "EPD_RUN_DIR": str(tmp_path)}
    launcher = subprocess.Popen([sys.executable, str(REPO / "bin" / "epd-launch"), str(tiny_dir), "--device", "cpu",
                                 "--port", str(port), "--drain-timeout", "300"],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(line.rstrip() for line in launcher.stdout), daemon=True)
    reader.start()
    pids: dict[str, int] = {}
    try:
        until(lambda: any(line.startswith("EPD ready") for line in lines), "the stack to be ready", 180)
        pids = {m.group(1): int(m.group(2)) for line in lines
                if (m := re.search(r"started (\S+) \(pid (\d+)", line))}
        assert sorted(pids) == ["encoder-0", "generator-0", "proxy"]
        sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=600)
        image = {"type": "image_url", "image_url": {"url": data_url(image_bytes(random_image(56, 56, seed=5)))}}
        stream = sdk.chat.completions.create(
            model=sdk.models.list().data[0].id, messages=[{"role": "user", "content": [image, {"type": "text", "text": "go on"}]}],
            max_tokens=TOKENS, temperature=0, stream=True, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True})
        chunks = iter(stream)
        first = next(chunks)
        assert first.choices
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=10)
        until(lambda: refused(port), "the proxy to stop listening", 30)
        assert alive(pids["encoder-0"]) and alive(pids["generator-0"]), "they stop only after the proxy"
        rest = list(chunks)   # the stream goes on to its end
        finish = [c.choices[0].finish_reason for c in rest if c.choices and c.choices[0].finish_reason]
        assert finish == ["length"] and rest[-1].usage.completion_tokens == TOKENS
        until(lambda: not any(alive(pid) for pid in pids.values()), "every stage to stop on its own", 60)
        assert not [s for s in Path("/dev/shm").glob("epd-*") if any(f"-{pid}-" in s.name for pid in pids.values())]
        assert not list((tmp_path / f"epd-{os.getuid()}" / f"port-{port}").glob("*.sock"))
    finally:
        try:   # a failed test: the stages share the launcher's process group
            os.killpg(launcher.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        launcher.wait(timeout=10)


def test_the_watch_sees_a_launcher_gone_only_where_one_started_the_stage(tmp_path):
    from pipeline import launcher_watch
    from pipeline.launcher_watch import LAUNCHER_PID_ENV, LauncherWatch, remove_own_files

    by_hand = LauncherWatch({})
    assert not by_hand.launcher_gone() and not by_hand.nobody_left()
    ours = LauncherWatch({LAUNCHER_PID_ENV: str(os.getppid())})
    assert not ours.launcher_gone()
    orphan = LauncherWatch({LAUNCHER_PID_ENV: str(os.getppid() + 100000)})
    assert orphan.launcher_gone() and not orphan.nobody_left()   # a proxy asked just now (at start)
    orphan.last_asked -= launcher_watch.QUIET_S + 1
    assert orphan.nobody_left()
    orphan.asked()
    assert not orphan.nobody_left()
    sock, signal_file = tmp_path / "x.sock", tmp_path / "generator-0.prefill"
    for path in (sock, signal_file):
        path.write_bytes(b"")
    remove_own_files(ours, f"ipc://{sock}", str(signal_file))
    assert sock.exists() and signal_file.exists()   # the launcher removes them, or a restarted stage reuses them
    remove_own_files(orphan, f"ipc://{sock}", None)
    assert not sock.exists() and signal_file.exists()
    remove_own_files(orphan, "tcp://127.0.0.1:5555", str(signal_file))
    assert not signal_file.exists()
