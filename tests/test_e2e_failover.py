"""Stages that die, stall, restart or are lied to, under load, with real
processes: nothing a client asked for is lost or duplicated, and nothing is
left held (leases, KV blocks, rings)."""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from conftest import image_bytes, random_image
from e2e_helpers import IMAGES, chat, long_requests, serving
from pipeline.arena import ring
from stack import Stack
from waiting import caught_up, stage_address, until


@pytest.fixture(scope="module")
def epd(tiny_dir, tmp_path_factory):
    """The users' topology: one encoder, three generators."""
    yield from serving(Stack(tmp_path_factory.mktemp("epd"), tiny_dir, encoders=1, generators=3))


def looks_down(stack: Stack, name: str) -> bool:
    """Whether the proxy's /health names stage `name` down (silent past its down timeout)."""
    r = httpx.get(stack.base_url + "/health", timeout=5)
    return r.status_code == 503 and stage_address(stack, name) in r.json()["down"]


def held_by_generators(stack: Stack) -> float:
    """Requests the generators hold, running or waiting (for their images, say), as last polled."""
    return stack.total("epd_running_requests") + stack.total("epd_waiting_requests")


def test_requests_keep_succeeding_while_a_generator_is_stopped(epd):
    stop_done = threading.Event()
    served: list[float] = []    # when each request of the load ended

    def load():
        while not stop_done.is_set():
            assert chat(epd, IMAGES[1], f"during failover {len(served)}", max_tokens=4)[2].completion_tokens == 4
            served.append(time.monotonic())

    def served_after(start: float, n: int) -> bool:
        for future in futures:
            if future.done():
                future.result()     # a request failed: raise it here
        return sum(ended > start for ended in served) >= n

    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(load) for _ in range(3)]
        try:
            until(lambda: served_after(0.0, 3), "the load to be served", deadline_s=60)
            epd.stop_stage("gen1")
            # Requests go on through gen1's down timeout (those it held move on) and after it.
            until(lambda: looks_down(epd, "gen1"), "the proxy to see gen1 down")
            down_at = time.monotonic()
            until(lambda: served_after(down_at, 12), "12 requests served with gen1 down", deadline_s=60)
        finally:
            stop_done.set()   # a failure above fails the test; without this the load would go on forever
        for future in futures:
            future.result(timeout=120)
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


def test_a_generator_that_stalls_past_the_timeout_then_wakes_sends_no_stale_tokens(epd):
    """Stopped for longer than the proxy's down timeout, a generator's
    requests move on; when it wakes, what it still produces for them is
    dropped (and it is told to stop), so each client gets each token once."""
    before = epd.total("epd_generation_tokens_total")

    def stall():
        moved = epd.whole_log().count("moved to generator")
        epd.procs["gen0"].send_signal(signal.SIGSTOP)
        # Once gen0 looks down the proxy moves all its requests in one go (a log line each).
        until(lambda: epd.whole_log().count("moved to generator") > moved, "the proxy to move gen0's requests on")
        epd.procs["gen0"].send_signal(signal.SIGCONT)

    results = long_requests(epd, 6, 3000, stall)
    assert [(usage.completion_tokens, reason) for reason, usage in results] == [(3000, "length")] * 6
    assert epd.total("epd_generation_tokens_total") - before == 6 * 3000
    epd.wait_healthy()
    caught_up(epd)      # stats are polled
    until(lambda: epd.total("epd_running_requests") == 0, "the generators to end every request")


@pytest.fixture(scope="module")
def patient(tiny_dir, tmp_path_factory):
    """A proxy whose down timeout (60 s) outlasts any restart here."""
    yield from serving(Stack(tmp_path_factory.mktemp("patient"), tiny_dir, encoders=1, generators=2,
                             proxy_args=("--stage-timeout", "60")))


def test_requests_survive_a_generator_that_dies_and_is_back_before_it_looks_down(patient):
    """systemd or epd-launch can restart a stage faster than the proxy's down
    timeout, so it never looks down; the requests it held died with it. The
    new incarnation's first stats reply reveals the restart, and the proxy
    sends them again (resuming after the tokens already streamed)."""
    def kill_and_restart():
        patient.stop_stage("gen0", signal.SIGKILL)
        patient.restart_stage("gen0")

    results = long_requests(patient, 4, 2000, kill_and_restart)
    assert [(usage.completion_tokens, reason) for reason, usage in results] == [(2000, "length")] * 4
    patient.wait_healthy()


def test_seeded_requests_moved_by_a_kill_sample_what_they_would_have_unmoved(patient):
    """A seeded request's sampler goes on across the move: the new
    generator skips the numbers its tokens before the move took."""
    seeded = dict(temperature=1.0, seed=4242)
    unmoved, moved = [], []
    long_requests(patient, 2, 1500, lambda: None, unmoved, **seeded)

    def kill_and_restart():
        patient.stop_stage("gen0", signal.SIGKILL)
        patient.stop_stage("gen1", signal.SIGKILL)   # wherever each request runs
        patient.restart_stage("gen0")
        patient.restart_stage("gen1")

    results = long_requests(patient, 2, 1500, kill_and_restart, moved, **seeded)
    assert [(usage.completion_tokens, reason) for reason, usage in results] == [(1500, "length")] * 2
    assert moved == unmoved and len(set(unmoved)) == 2
    patient.wait_healthy()


def test_encode_jobs_lost_with_an_encoder_that_is_back_before_it_looks_down_are_sent_again(patient):
    """Jobs queued at an encoder that is then killed and restarted at once
    are lost with it; its new incarnation gets them again."""
    patient.procs["enc0"].send_signal(signal.SIGSTOP)    # jobs pile up unread
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(chat, patient, [image_bytes(random_image(66, 88, seed=700 + i))], f"lost job {i}",
                               max_tokens=8, ignore_eos=True) for i in range(4)]
        # The proxy sends a request's encode jobs with it: the generators hold all four, so the jobs are sent.
        until(lambda: held_by_generators(patient) >= 4, "the generators to hold the four requests")
        patient.stop_stage("enc0", signal.SIGKILL)
        patient.restart_stage("enc0")
        results = [f.result(timeout=50) for f in futures]
    assert [usage.completion_tokens for _, _, usage in results] == [8] * 4
    patient.wait_healthy()


def test_a_restarted_proxy_makes_generators_drop_what_its_predecessor_asked_for(epd):
    """Requests of a proxy that died have no client left: once its next
    incarnation asks for stats, the generators abort them instead of
    generating into the void (here 7000 tokens each, many seconds)."""
    pool = ThreadPoolExecutor(3)
    futures = [pool.submit(chat, epd, [], f"orphan {i}", stream=True, max_tokens=7000, ignore_eos=True)
               for i in range(3)]
    until(lambda: epd.total("epd_running_requests") >= 3, "the three requests to run")
    epd.stop_stage("proxy", signal.SIGKILL)
    try:
        for future in futures:
            with pytest.raises(Exception):
                future.result(timeout=30)   # their proxy is gone
    finally:    # whatever failed here, the tests after this one get a proxy
        pool.shutdown()
        epd.restart_stage("proxy")
    epd.wait_healthy()     # every stage has answered the new proxy: what it shows is from after the restart
    # Bounded: left to run, the 7000 tokens each would take far longer than this.
    until(lambda: not (epd.total("epd_running_requests") or epd.total("epd_kv_blocks_used")),
          "the generators to drop the orphans", deadline_s=8)
    assert chat(epd, IMAGES[1], "after the restart", max_tokens=4)[2].completion_tokens == 4


def rings_of(instance: str) -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").glob(f"epd-{instance}-*-ring*"))


def test_embeddings_reach_generators_through_rings_and_a_killed_generators_ring_is_replaced(epd):
    """Same host: EmbeddingReady goes through each generator's shared-memory
    ring, not its socket. A generator killed outright leaves its ring behind;
    its next incarnation removes it, makes its own, and gets handoffs on it."""
    def ring_handoffs():
        caught_up(epd)  # stats are polled
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
    (new,) = until(lambda: (rings := rings_of(instance)) != [old] and len(rings) == 1 and rings,
                   "the new incarnation's ring in place of the old one", deadline_s=60, interval_s=0.2)
    assert new != old
    # Its hello named a new incarnation: the encoder dropped what the killed one leased.
    assert epd.wait_for_log("gen2.sock restarted: dropped"), epd.logs()
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


def test_image_requests_wait_out_the_only_encoders_restart(epd):
    """The users' topology has one encoder. Killed, it is down for longer
    than the proxy's timeout while epd-launch restarts it (loading a real
    tower takes seconds): the image requests it held, and those that come
    meanwhile, wait for its next incarnation instead of failing; text-only
    requests are served all along."""
    epd.procs["enc0"].send_signal(signal.SIGSTOP)    # jobs pile up unread, then die with it
    with ThreadPoolExecutor(6) as pool:
        held = [pool.submit(chat, epd, [image_bytes(random_image(61, 77, seed=1100 + i))], f"held {i}",
                            max_tokens=6, ignore_eos=True) for i in range(3)]
        # The proxy sends a request's encode jobs with it: the generators hold the three, so the jobs are sent.
        until(lambda: held_by_generators(epd) >= 3, "the generators to hold the three requests")
        epd.stop_stage("enc0", signal.SIGKILL)
        until(lambda: looks_down(epd, "enc0"), "the proxy to see enc0 down")   # past the 3 s down timeout
        meanwhile = [pool.submit(chat, epd, [image_bytes(random_image(61, 77, seed=1200 + i))], f"new {i}",
                                 max_tokens=6, ignore_eos=True) for i in range(3)]
        assert chat(epd, [], "text goes on", max_tokens=4)[2].completion_tokens == 4
        until(lambda: held_by_generators(epd) >= 6, "the generators to hold the new requests too")
        epd.restart_stage("enc0")
        results = [f.result(timeout=60) for f in held + meanwhile]
    assert [usage.completion_tokens for _, _, usage in results] == [6] * 6
    epd.wait_healthy()
    caught_up(epd)   # stats are polled
    until(lambda: not (epd.total("epd_running_requests") or epd.total("epd_kv_blocks_used")),
          "the generators to give back every request's slot and blocks")
