"""The whole EPD path with real processes and the official openai SDK."""

from __future__ import annotations

import base64
import json
import signal
import subprocess
import re
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from conftest import REPO, image_bytes, random_image
from pipeline.arena import ring
from pipeline.cpu_threads import threads_per_stage, usable_cpus
from stack import Stack


@pytest.fixture(scope="module")
def epd(tiny_dir, tmp_path_factory):
    stack = Stack(tmp_path_factory.mktemp("epd"), tiny_dir, encoders=1, generators=3)
    try:
        stack.wait_healthy()
        yield stack
    finally:
        stack.close()


@pytest.fixture(scope="module")
def aggregated(tiny_dir, tmp_path_factory):
    stack = Stack(tmp_path_factory.mktemp("agg"), tiny_dir, encoders=0, generators=2, aggregated=True)
    try:
        stack.wait_healthy()
        yield stack
    finally:
        stack.close()


def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)


def data_url(data: bytes, mime="image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def chat_messages(images: list[bytes], text: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": data_url(b)}} for b in images]
    return [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]


def chat(stack, images, text, stream=False, max_tokens=16, **extra):
    c = client(stack)
    kwargs = dict(model="tiny", messages=chat_messages(images, text), max_tokens=max_tokens, temperature=0,
                  extra_body=extra or None)
    if not stream:
        r = c.chat.completions.create(**kwargs)
        return r.choices[0].message.content, r.choices[0].finish_reason, r.usage
    chunks = c.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    text_out, reason, usage = "", None, None
    for chunk in chunks:
        if chunk.choices:
            text_out += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
        if chunk.usage:
            usage = chunk.usage
    return text_out, reason, usage


IMAGES = {n: [image_bytes(random_image(80 + 40 * i, 120 - 10 * i, seed=50 + i)) for i in range(n)] for n in (0, 1, 2)}


def epd_generate(tiny_dir, tmp_path, images, text, max_tokens=16):
    args = []
    for i, b in enumerate(images):
        path = tmp_path / f"img{i}.png"
        path.write_bytes(b)
        args += ["--image", str(path)]
    run = subprocess.run([sys.executable, str(REPO / "bin" / "epd-generate"), "--model", str(tiny_dir),
                          "--prompt", text, *args, "--max-tokens", str(max_tokens), "--json"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.splitlines()[-1])


@pytest.mark.parametrize("num_images", [0, 1, 2])
def test_chat_equals_offline_generation_and_aggregated_mode(epd, aggregated, tiny_dir, tmp_path, num_images):
    text = f"Describe these {num_images} pictures."
    expected = epd_generate(tiny_dir, tmp_path, IMAGES[num_images], text)
    for stream in (False, True):
        got, reason, usage = chat(epd, IMAGES[num_images], text, stream=stream)
        assert got == expected["text"]
        assert usage.prompt_tokens == len(expected["prompt_token_ids"])
        assert usage.completion_tokens == len(expected["token_ids"])
        assert reason in ("stop", "length")
        assert chat(aggregated, IMAGES[num_images], text, stream=stream)[0] == expected["text"]


def test_completions_models_and_health(epd):
    c = client(epd)
    assert [m.id for m in c.models.list().data] == ["tiny"]
    r = c.completions.create(model="tiny", prompt="Once upon a time", max_tokens=5, temperature=0)
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    assert httpx.get(epd.base_url + "/health").status_code == 200


def test_model_stages_split_the_cores_among_them(epd):
    """Each of the 4 model stages runs torch on its share of the cores, not
    on all of them: 8 spinning threads on CI's 2 cores made 3-sequence
    decode steps take 350 ms, and a 300-token test time out."""
    share = threads_per_stage(4, usable_cpus())
    counts = re.findall(r"ready on \S+ \(.*, (\d+) CPU threads\)", epd.logs())
    assert len(counts) >= 4 and set(counts) == {str(share)}, counts


def test_64_concurrent_mixed_requests_succeed(epd):
    def one(i):
        images = IMAGES[i % 3] if i % 4 else [image_bytes(random_image(64, 64 + i, seed=1000 + i))]
        return chat(epd, images, f"request {i}", stream=bool(i % 2), max_tokens=8, ignore_eos=True)

    with ThreadPoolExecutor(64) as pool:
        results = list(pool.map(one, range(64)))
    assert all(usage.completion_tokens == 8 and reason == "length" for _, reason, usage in results)


def test_ten_concurrent_copies_of_a_new_image_are_encoded_once(epd):
    image = image_bytes(random_image(100, 100, seed=4242))
    time.sleep(1.5)  # stats are polled: the earlier tests' encodes are counted before `before`
    before = epd.total("epd_encoder_jobs_total", outcome="encoded")
    with ThreadPoolExecutor(10) as pool:
        results = list(pool.map(lambda i: chat(epd, [image], f"same image {i}", max_tokens=4), range(10)))
    assert len(results) == 10
    time.sleep(1.5)  # stats are polled
    assert epd.total("epd_encoder_jobs_total", outcome="encoded") - before == 1


def test_metrics_show_where_stage_time_goes(epd):
    """The step and encoder totals behind /metrics move with the work: one
    new image and 6 tokens add a vision forward, an image decode, and
    decode steps with their time."""
    names = {"steps": ("epd_generator_steps_total", "kind", "decode"),
             "step_seconds": ("epd_generator_step_seconds_total", "kind", "decode"),
             "forwards": ("epd_encoder_images_total", "phase", "forward"),
             "decodes": ("epd_encoder_images_total", "phase", "decode"),
             "forward_seconds": ("epd_encoder_busy_seconds_total", "phase", "forward")}
    before = {k: epd.total(name, **{label: value}) for k, (name, label, value) in names.items()}
    chat(epd, [image_bytes(random_image(72, 96, seed=5151))], "where does time go", max_tokens=6, ignore_eos=True)
    time.sleep(1.5)  # stats are polled
    after = {k: epd.total(name, **{label: value}) for k, (name, label, value) in names.items()}
    assert after["forwards"] - before["forwards"] == 1 and after["decodes"] - before["decodes"] == 1
    assert after["steps"] - before["steps"] >= 5     # 6 tokens: the first from the prefill, 5 decode steps
    assert after["step_seconds"] > before["step_seconds"] and after["forward_seconds"] > before["forward_seconds"]


def test_client_aborts_leave_nothing_held(epd):
    def abandon(i):
        try:
            with httpx.stream("POST", epd.base_url + "/v1/chat/completions", timeout=30, json={
                    "model": "tiny", "messages": chat_messages(IMAGES[1], f"long {i}"), "max_tokens": 4000,
                    "stream": True, "ignore_eos": True}) as r:
                for n, _ in enumerate(r.iter_lines()):
                    if n > 3:
                        return  # hang up mid-stream
        except httpx.HTTPError:
            pass

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(abandon, range(8)))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        time.sleep(1.0)
        if epd.total("epd_kv_blocks_used") == 0 and epd.total("epd_arena_leases") == 0 \
                and epd.total("epd_running_requests") == 0:
            break
    assert epd.total("epd_kv_blocks_used") == 0
    assert epd.total("epd_arena_leases") == 0
    assert epd.total("epd_running_requests") == 0


@pytest.mark.parametrize("body,status,fragment", [
    (b"{not json", 400, "malformed JSON"),
    (json.dumps({"model": "tiny", "messages": []}).encode(), 400, "messages"),
    (json.dumps({"model": "tiny", "messages": chat_messages([b"garbage bytes"], "x")}).encode(), 400, "image 1"),
    # A valid header but truncated pixels: caught by the encoder, still the client's error.
    (json.dumps({"model": "tiny", "messages": chat_messages(
        [image_bytes(random_image(200, 200, seed=77), "JPEG")[:700]], "x")}).encode(), 400, "could not be encoded"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "ftp://example/x.png"}}]}]}).encode(), 400, "unsupported image URL"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "word " * 9000}]}).encode(), 400,
     "maximum context length"),
    (json.dumps({"model": "tiny", "messages": chat_messages(IMAGES[1] * 17, "x")}).encode(), 400, "too many images"),
    (json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "temperature": -1}).encode(), 400,
     "temperature"),
])
def test_bad_input_gets_a_clear_4xx_and_harms_no_one(epd, body, status, fragment):
    r = httpx.post(epd.base_url + "/v1/chat/completions", content=body,
                   headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == status, r.text
    assert fragment in r.json()["error"]["message"]
    assert chat(epd, IMAGES[1], "still fine?", max_tokens=4)[2].completion_tokens == 4


def test_requests_keep_succeeding_while_a_generator_is_stopped(epd):
    stop_done = threading.Event()

    def load():
        ok = 0
        while not stop_done.is_set() or ok < 12:
            assert chat(epd, IMAGES[1], f"during failover {ok}", max_tokens=4)[2].completion_tokens == 4
            ok += 1
        return ok

    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(load) for _ in range(3)]
        time.sleep(1.0)
        epd.stop_stage("gen1")
        time.sleep(4.0)
        stop_done.set()
        counts = [f.result(timeout=120) for f in futures]
    assert sum(counts) >= 36
    epd.restart_stage("gen1")
    epd.wait_healthy()


def test_a_bogus_arena_announcement_harms_no_generator(epd):
    """An announcement is input from another process: one naming a path, or
    a segment that is not there, is logged and skipped, and every generator
    keeps serving."""
    import zmq

    from pipeline import protocol
    from pipeline.arena.shm import segment_name

    bogus = [protocol.ArenaInfo("intruder-1", "shm", 1 << 20, 1 << 16, "../../etc/passwd", "x"),
             protocol.ArenaInfo("intruder-2", "shm", 1 << 20, 1 << 16, segment_name("nobody", "gen", pid=1),
                                segment_name("nobody", "data", pid=1))]
    ctx = zmq.Context()
    try:
        for i in range(3):
            sock = ctx.socket(zmq.PUSH)
            sock.connect(f"ipc://{epd.run_dir}/gen{i}.sock")
            for info in bogus:
                sock.send(protocol.encode(protocol.EncoderAnnounce("intruder", "ipc:///nowhere", "tiny", info,
                                                                   {"image": 64})))
            sock.close(linger=2000)
    finally:
        ctx.term()
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda i: chat(epd, IMAGES[1], f"after the intruder {i}", max_tokens=4,
                                               ignore_eos=True), range(6)))
    assert all(usage.completion_tokens == 4 for _, _, usage in results)
    assert epd.logs().count("cannot open the arena that encoder intruder announced") >= 2


def long_requests(stack, n: int, max_tokens: int, disturb) -> list:
    """n streamed requests that run long enough for `disturb()` to hit them."""
    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(chat, stack, IMAGES[1], f"long {i}", stream=True, max_tokens=max_tokens,
                               ignore_eos=True) for i in range(n)]
        time.sleep(1.5)     # all running: least-loaded routing spread them over the generators
        disturb()
        return [f.result(timeout=50) for f in futures]


def test_a_generator_that_stalls_past_the_timeout_then_wakes_sends_no_stale_tokens(epd):
    """Stopped for longer than the proxy's down timeout, a generator's
    requests move on; when it wakes, what it still produces for them is
    dropped (and it is told to stop), so each client gets each token once."""
    before = epd.total("epd_generation_tokens_total")

    def stall():
        epd.procs["gen0"].send_signal(signal.SIGSTOP)
        time.sleep(5.0)
        epd.procs["gen0"].send_signal(signal.SIGCONT)

    results = long_requests(epd, 6, 300, stall)
    assert [(usage.completion_tokens, reason) for _, reason, usage in results] == [(300, "length")] * 6
    assert epd.total("epd_generation_tokens_total") - before == 6 * 300
    epd.wait_healthy()
    time.sleep(1.5)     # stats are polled
    assert epd.total("epd_running_requests") == 0


@pytest.fixture(scope="module")
def patient(tiny_dir, tmp_path_factory):
    """A proxy whose down timeout (60 s) outlasts any restart here."""
    stack = Stack(tmp_path_factory.mktemp("patient"), tiny_dir, encoders=1, generators=2,
                  proxy_args=("--stage-timeout", "60"))
    try:
        stack.wait_healthy()
        yield stack
    finally:
        stack.close()


def test_requests_survive_a_generator_that_dies_and_is_back_before_it_looks_down(patient):
    """systemd or epd-launch can restart a stage faster than the proxy's down
    timeout, so it never looks down; the requests it held died with it. The
    new incarnation's first stats reply reveals the restart, and the proxy
    sends them again (resuming after the tokens already streamed)."""
    def kill_and_restart():
        patient.stop_stage("gen0", signal.SIGKILL)
        patient.restart_stage("gen0")

    results = long_requests(patient, 4, 200, kill_and_restart)
    assert [(usage.completion_tokens, reason) for _, reason, usage in results] == [(200, "length")] * 4
    patient.wait_healthy()


def test_encode_jobs_lost_with_an_encoder_that_is_back_before_it_looks_down_are_sent_again(patient):
    """Jobs queued at an encoder that is then killed and restarted at once
    are lost with it; its new incarnation gets them again."""
    patient.procs["enc0"].send_signal(signal.SIGSTOP)    # jobs pile up unread
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(chat, patient, [image_bytes(random_image(66, 88, seed=700 + i))], f"lost job {i}",
                               max_tokens=8, ignore_eos=True) for i in range(4)]
        time.sleep(1.5)
        patient.stop_stage("enc0", signal.SIGKILL)
        patient.restart_stage("enc0")
        results = [f.result(timeout=50) for f in futures]
    assert [usage.completion_tokens for _, _, usage in results] == [8] * 4
    patient.wait_healthy()


def test_a_restarted_proxy_makes_generators_drop_what_its_predecessor_asked_for(epd):
    """Requests of a proxy that died have no client left: once its next
    incarnation asks for stats, the generators abort them instead of
    generating into the void (here 1000 tokens each, about 25 s)."""
    pool = ThreadPoolExecutor(3)
    futures = [pool.submit(chat, epd, [], f"orphan {i}", stream=True, max_tokens=1000, ignore_eos=True)
               for i in range(3)]
    time.sleep(1.5)
    assert epd.total("epd_running_requests") >= 1
    epd.stop_stage("proxy", signal.SIGKILL)
    for future in futures:
        with pytest.raises(Exception):
            future.result(timeout=30)   # their proxy is gone
    pool.shutdown()
    epd.restart_stage("proxy")
    epd.wait_healthy()
    deadline = time.monotonic() + 8
    while time.monotonic() < deadline and (epd.total("epd_running_requests") or epd.total("epd_kv_blocks_used")):
        time.sleep(0.5)
    assert epd.total("epd_running_requests") == 0 and epd.total("epd_kv_blocks_used") == 0
    assert chat(epd, IMAGES[1], "after the restart", max_tokens=4)[2].completion_tokens == 4


def rings_of(instance: str) -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").glob(f"epd-{instance}-*-ring*"))


def test_embeddings_reach_generators_through_rings_and_a_killed_generators_ring_is_replaced(epd):
    """Same host: EmbeddingReady goes through each generator's shared-memory
    ring, not its socket. A generator killed outright leaves its ring behind;
    its next incarnation removes it, makes its own, and gets handoffs on it."""
    def ring_handoffs():
        time.sleep(1.5)  # stats are polled
        return epd.total("epd_encoder_handoffs_total", lane="ring")

    before, wakes = ring_handoffs(), epd.total("epd_encoder_ring_wakes_total")
    for i in range(6):   # the proxy spreads these over the generators
        chat(epd, [image_bytes(random_image(90, 60 + i, seed=900 + i))], f"ring {i}", max_tokens=2)
    assert ring_handoffs() - before >= 6
    # A generator waiting only on an image blocks on its socket with its ring's
    # flag raised; the encoder saw the flag and woke it by socket.
    assert epd.total("epd_encoder_ring_wakes_total") > wakes
    instance = epd.generator_instances[2]
    (old,) = rings_of(instance)
    epd.stop_stage("gen2", signal.SIGKILL)
    assert rings_of(instance) == [old]      # nothing removed it: the process had no chance
    epd.restart_stage("gen2")
    epd.wait_healthy()
    deadline = time.monotonic() + 60
    while (rings_of(instance) == [old] or len(rings_of(instance)) != 1) and time.monotonic() < deadline:
        time.sleep(0.2)
    (new,) = rings_of(instance)
    assert new != old
    # Its hello named a new incarnation: the encoder dropped what the killed one leased.
    assert "gen2.sock restarted: dropped" in epd.logs()
    lane = ring.attach(f"{new}")
    try:
        before = ring_handoffs()
        with ThreadPoolExecutor(12) as pool:   # at once: least-loaded routing spreads them over all three
            list(pool.map(lambda i: chat(epd, [image_bytes(random_image(70, 50 + i, seed=950 + i))],
                                         f"after restart {i}", max_tokens=8, ignore_eos=True), range(12)))
        assert ring_handoffs() - before >= 12
        assert lane.written > 0     # some of them went to the new incarnation's ring
    finally:
        lane.close()
