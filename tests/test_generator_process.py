"""Real encoder and generator processes on the tiny model; this test plays
the proxy: it sends encode jobs and generate requests at the same time."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import zmq

from conftest import REPO, image_bytes, random_image
from pipeline import protocol, transport
from pipeline.arena.shm import remove_stale_segments
from pipeline.generate import GenerationLimits, greedy_generate
from pipeline.hashing import content_hash, media_salt
from pipeline.models.loader import load_model
from pipeline.processing.image import open_image, preprocess_images
from pipeline.processing.processor import Processor
from waiting import until

MAX_TOKENS = 10


def start(args, log):
    return subprocess.Popen([sys.executable, "-m", *args], cwd=REPO, stdout=log, stderr=subprocess.STDOUT)


@pytest.fixture
def stages(tiny_dir, tmp_path):
    run = tmp_path
    addr = {name: f"ipc://{run}/{name}.sock" for name in ("enc", "gen", "agg", "me")}
    instance = f"test-genenc-{os.getpid()}"
    log = open(run / "stages.log", "w")
    procs = [
        start(["stages.encoder", "--address", addr["enc"], "--model", str(tiny_dir), "--device", "cpu", "--cpu-threads", "1",
               "--instance", instance, "--media-backend", "pillow", "--arena-mib", "8", "--model-id", "tiny"], log),
        start(["stages.generator", "--address", addr["gen"], "--model", str(tiny_dir), "--device", "cpu", "--cpu-threads", "1",
               "--encoders", addr["enc"], "--kv-cache-mib", "8", "--embedding-timeout", "8"], log),
        start(["stages.generator", "--address", addr["agg"], "--model", str(tiny_dir), "--device", "cpu", "--cpu-threads", "1",
               "--mode", "aggregated", "--media-backend", "pillow", "--kv-cache-mib", "8"], log),
    ]
    yield addr, procs, run / "stages.log"
    stop(procs, instance, log)


def stop(procs, instance: str, log) -> None:
    """SIGTERM every stage (SIGKILL after 20 s), then remove what they left in /dev/shm."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
    remove_stale_segments(instance)
    log.close()


class Proxy:
    def __init__(self, addr, tiny_dir):
        self.ctx = zmq.Context()
        self.addr = addr
        self.inbox = transport.make_socket(self.ctx, zmq.PULL, addr["me"], bind=True)
        self.out = transport.Outbox(self.ctx)
        loaded = load_model(tiny_dir)
        self.model = loaded.model
        self.processor = Processor.from_checkpoint(tiny_dir, loaded.config.image_token_id)
        self.salt = media_salt("tiny", self.processor.image_config.settings_key())

    def recv(self, timeout=60):
        if not self.inbox.poll(timeout * 1000):
            raise TimeoutError("no message")
        return protocol.decode(self.inbox.recv())

    def request(self, rid, text, images, generator="gen", send_jobs=True, max_tokens=MAX_TOKENS,
                send_request=True):
        decoded = [open_image(b, self.processor.image_config) for b in images]
        messages = [{"role": "user", "content": [{"type": "image"}] * len(images) + [{"type": "text", "text": text}]}]
        prompt = self.processor.chat_prompt(messages, [(im.height, im.width) for im in decoded])
        keys = [content_hash(b, self.salt) for b in images]
        if generator == "gen" and send_jobs:
            for i, (b, (_, length)) in enumerate(zip(images, prompt.image_spans)):
                if send_jobs is not True and i not in send_jobs:    # only the images listed
                    continue
                self.out.send(self.addr["enc"], protocol.EncodeJob(f"{rid}-{i}", rid, keys[i], b, self.addr["gen"],
                                                                   length, self.addr["me"]))
        if not send_request:
            return prompt, decoded
        sampling = protocol.Sampling(max_tokens=max_tokens, ignore_eos=True)
        self.out.send(self.addr[generator], protocol.GenerateRequest(
            rid, tuple(prompt.token_ids), tuple(prompt.image_spans), tuple(keys), tuple(prompt.grids), sampling,
            self.addr["me"], tuple(images) if generator == "agg" else ()))
        return prompt, decoded

    def expected(self, prompt, decoded):
        pixels = preprocess_images(decoded, self.processor.image_config)[0] if decoded else None
        return greedy_generate(self.model, prompt, pixels, GenerationLimits(MAX_TOKENS, frozenset(), True))

    def collect(self, rids):
        tokens = {r: [] for r in rids}
        done = {}
        while len(done) < len(rids):
            msg = self.recv()
            if isinstance(msg, protocol.TokenDelta) and msg.request_id in tokens:
                tokens[msg.request_id] += msg.token_ids
                if msg.finished:
                    done[msg.request_id] = msg
        return tokens, done

    def stats(self, target):
        self.out.send(self.addr[target], protocol.StatsRequest(self.addr["me"]))
        latest = None
        # Replies to wait_ready's repeated asking may still be queued ahead of
        # ours: the last one that comes is the fresh one.
        while latest is None or self.inbox.poll(300):
            msg = self.recv()
            if isinstance(msg, protocol.StageStats) and msg.address == self.addr[target]:
                latest = msg
        return latest

    def close(self):
        self.inbox.close()
        self.out.close()
        self.ctx.term()


def wait_ready(proxy, targets, timeout=120):
    deadline = time.monotonic() + timeout
    for target in targets:
        while True:
            try:
                proxy.out.send(proxy.addr[target], protocol.StatsRequest(proxy.addr["me"]))
                msg = proxy.recv(timeout=1)
                if isinstance(msg, protocol.StageStats):
                    break
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise


def test_epd_and_aggregated_generators_match_offline_generation(stages, tiny_dir):
    addr, procs, log_path = stages
    proxy = Proxy(addr, tiny_dir)
    try:
        wait_ready(proxy, ["enc", "gen", "agg"])
        images = [image_bytes(random_image(90 + 30 * i, 140 - 20 * i, seed=i), "PNG") for i in range(3)]
        cases = {"t0": [], "t1": images[:1], "t2": images[1:3], "t3": images[:2]}
        expected = {}
        for rid, imgs in cases.items():
            for generator in ("gen", "agg"):
                prompt, decoded = proxy.request(f"{generator}-{rid}", f"Tell me about {rid}.", imgs, generator)
            expected[rid] = proxy.expected(prompt, decoded)
        tokens, done = proxy.collect([f"{g}-{r}" for r in cases for g in ("gen", "agg")])
        for rid in cases:
            assert tokens[f"gen-{rid}"] == expected[rid], (rid, done[f"gen-{rid}"])
            assert tokens[f"agg-{rid}"] == expected[rid], rid
            assert done[f"gen-{rid}"].finish_reason == "length"

        # An image that never arrives: a clear error once the deadline passes.
        proxy.request("lost", "Where is it?", [image_bytes(random_image(64, 64, seed=9))], "gen", send_jobs=False)
        _, done = proxy.collect(["lost"])
        assert done["lost"].finish_reason == "error"
        assert "did not arrive within 8 s" in done["lost"].error

        # Abort mid-way: everything is given back.
        proxy.request("long", "Go on.", images[:1], "gen", max_tokens=5000)
        first = proxy.recv()
        assert isinstance(first, protocol.TokenDelta)
        proxy.out.send(addr["gen"], protocol.AbortRequest(("long",)))
        deadline = time.monotonic() + 10
        while (gen := proxy.stats("gen")).gauges["running"] != 0:
            assert time.monotonic() < deadline, "the aborted request is still running"
        assert gen.gauges["kv_blocks_used"] == 0 and gen.gauges["encoder_cache_tokens"] == 0
        enc = proxy.stats("enc")
        assert enc.gauges["arena_leases"] == 0
        # An abort right behind an aggregated-mode request (whose images are
        # still being decoded) still stops it.
        taken = proxy.stats("agg").counters["requests"]
        big = image_bytes(random_image(1400, 1400, seed=5), "PNG")   # slow to decode: the abort overtakes it
        proxy.request("agg-gone", "Go on.", [big], "agg", max_tokens=4000)   # seconds, unless stopped
        proxy.out.send(addr["agg"], protocol.AbortRequest(("agg-gone",)))
        proxy.request("agg-after", "Next.", [], "agg")
        tokens, _ = proxy.collect(["agg-after"])
        assert len(tokens["agg-after"]) == MAX_TOKENS
        # Bounded, to see that something does not happen: had the abort been missed, agg-gone's image
        # (decoded in well under a second) would have put it in the engine by now, counted and running
        # for seconds. Nothing observable says "skipped" sooner.
        time.sleep(1.0)
        agg = proxy.stats("agg")
        assert agg.counters["requests"] == taken + 1       # agg-after's only
        assert agg.gauges["kv_blocks_used"] == 0 and agg.gauges["running"] == 0
    except Exception:
        print(log_path.read_text()[-4000:])
        raise
    finally:
        proxy.close()


def test_an_embedding_that_overtakes_its_request_is_kept_for_it(stages, tiny_dir):
    """A ring delivers EmbeddingReady faster than the proxy's socket delivers
    the request it is for. Here it arrives while another request holds the
    same image in the cache, and that one ends before the late request comes:
    the late request must still find its embedding, not wait for a second."""
    addr, procs, log_path = stages
    proxy = Proxy(addr, tiny_dir)
    try:
        wait_ready(proxy, ["enc", "gen"])
        image, never = image_bytes(random_image(72, 96, seed=31), "PNG"), image_bytes(random_image(64, 64, seed=32))
        # The holder needs both; the first never comes, so its prefill stops
        # there and the second stays in the cache, needed.
        holder, _ = proxy.request("holder", "Hold it.", [never, image], send_jobs=(1,))
        image_tokens = holder.image_spans[1][1]
        until(lambda: proxy.stats("gen").gauges["encoder_cache_tokens"] == image_tokens, "the image in the cache")
        proxy.request("late", "Describe it.", [image], send_request=False)   # the embedding goes first
        until(lambda: proxy.stats("gen").gauges["early_embeddings"] == 1, "the late request's embedding, early")
        proxy.out.send(addr["gen"], protocol.AbortRequest(("holder",)))
        # The holder is gone, and with it the cache's entry.
        until(lambda: (s := proxy.stats("gen")).gauges["running"] + s.gauges["waiting"] == 0
              and s.gauges["encoder_cache_tokens"] == 0, "the holder and its cache entry gone")
        prompt, decoded = proxy.request("late", "Describe it.", [image], send_jobs=False)
        tokens, done = proxy.collect(["late"])
        assert done["late"].finish_reason == "length", done["late"].error
        assert tokens["late"] == proxy.expected(prompt, decoded)
        until(lambda: (s := proxy.stats("gen")).gauges["encoder_cache_tokens"] == 0
              and s.gauges["early_embeddings"] == 0, "the late request's embedding freed")
        until(lambda: proxy.stats("enc").gauges["arena_leases"] == 0, "the encoder's leases back")
    except Exception:
        print(log_path.read_text()[-4000:])
        raise
    finally:
        proxy.close()


def test_a_handle_whose_arena_cannot_be_opened_is_given_up_not_held(stages, tiny_dir, tmp_path):
    """A handle from an encoder whose arena does not open here (its mapping
    failed) holds a lease that pins the embedding in that encoder's arena:
    the generator gives it back and fails the request with the reason, at
    once, instead of holding both until the embedding deadline."""
    from pipeline.arena.shm import segment_name

    addr, procs, log_path = stages
    proxy = Proxy(addr, tiny_dir)
    ghost_address = f"ipc://{tmp_path}/ghost.sock"
    ghost = transport.make_socket(proxy.ctx, zmq.PULL, ghost_address, bind=True)
    try:
        wait_ready(proxy, ["enc", "gen"])
        image = [image_bytes(random_image(60, 70, seed=41), "PNG")]
        prompt, _ = proxy.request("ghosted", "Where from?", image, send_jobs=False)
        key = content_hash(image[0], proxy.salt)
        tokens = prompt.image_spans[0][1]
        handle = protocol.ArenaHandle("ghost-arena", 0, tokens * 64 * 4, (tokens, 64), "float32", 1)
        proxy.out.send(addr["gen"], protocol.EmbeddingReady("ghosted/0", "ghosted", key, handle, "lease-1", "ghost"))
        # Sent behind it on the same pipe, so the generator has parked the handle (its arena unknown) by then.
        arena = protocol.ArenaInfo("ghost-arena", "shm", 1 << 20, 1 << 16, segment_name("ghost", "gen", pid=1),
                                   segment_name("ghost", "data", pid=1))
        proxy.out.send(addr["gen"], protocol.EncoderAnnounce("ghost", ghost_address, "tiny", arena, {"image": 64}))
        assert ghost.poll(5000), "the lease was not given back"
        released = protocol.decode(ghost.recv())
        assert isinstance(released, protocol.ReleaseLease) and released.lease_ids == ("lease-1",)
        _, done = proxy.collect(["ghosted"])
        assert done["ghosted"].finish_reason == "error" and "unreadable" in done["ghosted"].error
        assert done["ghosted"].status == 500
    except Exception:
        print(log_path.read_text()[-4000:])
        raise
    finally:
        ghost.close()
        proxy.close()


def test_an_embedding_for_a_request_that_ended_is_given_back_unread(stages, tiny_dir):
    """The client hung up while its image was being encoded: the embedding
    that comes after the abort is not copied and held for a request that will
    never come back; its lease goes straight back."""
    addr, procs, log_path = stages
    proxy = Proxy(addr, tiny_dir)
    try:
        wait_ready(proxy, ["enc", "gen"])
        image = [image_bytes(random_image(58, 74, seed=51), "PNG")]

        def held() -> float:
            gauges = proxy.stats("gen").gauges
            return gauges["running"] + gauges["waiting"]

        proxy.request("gone", "Anyone?", image, send_jobs=False)
        until(lambda: held() == 1, "the generator to take the request")
        proxy.out.send(addr["gen"], protocol.AbortRequest(("gone",)))
        until(lambda: held() == 0, "the generator to end the aborted request")
        proxy.request("gone", "Anyone?", image, send_request=False)    # its encode job, late
        # Encoded, and its lease given back: the generator has met the embedding and handed it back.
        until(lambda: (s := proxy.stats("enc")).counters.get("encoded") == 1 and s.gauges["arena_leases"] == 0,
              "the embedding encoded and its lease back")
        gen = proxy.stats("gen")
        assert gen.gauges["early_embeddings"] == 0 and gen.gauges["pending_embeddings"] == 0
        assert gen.counters["embeddings"] == 0      # never copied out of the arena
    except Exception:
        print(log_path.read_text()[-4000:])
        raise
    finally:
        proxy.close()


@pytest.fixture
def small_cache_stages(tiny_dir, tmp_path):
    """An encoder and a generator whose encoder cache holds one 16-token image
    and which runs one request at a time."""
    addr = {name: f"ipc://{tmp_path}/{name}.sock" for name in ("enc", "gen", "me")}
    instance = f"test-parking-{os.getpid()}"
    log = open(tmp_path / "stages.log", "w")
    procs = [
        start(["stages.encoder", "--address", addr["enc"], "--model", str(tiny_dir), "--device", "cpu", "--cpu-threads", "1",
               "--instance", instance, "--media-backend", "pillow", "--arena-mib", "8", "--model-id", "tiny"], log),
        start(["stages.generator", "--address", addr["gen"], "--model", str(tiny_dir), "--device", "cpu", "--cpu-threads", "1",
               "--encoders", addr["enc"], "--kv-cache-mib", "8", "--encoder-cache-tokens", "24",
               "--max-num-seqs", "1"], log),
    ]
    yield addr, tmp_path / "stages.log"
    stop(procs, instance, log)


def test_embeddings_past_the_cache_wait_in_the_arena_and_every_request_completes(small_cache_stages, tiny_dir):
    """A generator that runs one request at a time, and that one waits for an
    image that never comes: of the twelve embeddings announced for the
    requests behind it, one fills the cache, one more is copied and waits as
    pending, and the rest stay parked in the encoder's arena (leased), not
    copied onto the generator's device. Once the holder is aborted each is
    read in turn; every request gets its exact tokens and every lease comes
    back."""
    addr, log_path = small_cache_stages
    proxy = Proxy(addr, tiny_dir)
    try:
        wait_ready(proxy, ["enc", "gen"])
        never, held = (image_bytes(random_image(112, 112, seed=s), "PNG") for s in (38, 39))
        proxy.request("holder", "Hold it.", [never, held], send_jobs=(1,), max_tokens=5000)
        until(lambda: proxy.stats("gen").gauges["encoder_cache_tokens"] == 16, "the holder's image in the cache")
        images = [image_bytes(random_image(112, 112, seed=40 + i), "PNG") for i in range(12)]
        expected = {}
        for r in range(6):
            prompt, decoded = proxy.request(f"p{r}", f"Compare {r}.", images[2 * r:2 * r + 2])
            expected[f"p{r}"] = proxy.expected(prompt, decoded)
        until(lambda: proxy.stats("gen").gauges["parked_embeddings"] >= 5, "embeddings parked")
        gen = proxy.stats("gen")
        assert gen.gauges["pending_embeddings"] == 1 and gen.gauges["encoder_cache_tokens"] == 16
        proxy.out.send(addr["gen"], protocol.AbortRequest(("holder",)))
        tokens, done = proxy.collect(list(expected))
        for rid, want in expected.items():
            assert done[rid].finish_reason == "length", done[rid].error
            assert tokens[rid] == want, rid
        # A refetched duplicate may still be parked for an ended request: given back on the next turn.
        until(lambda: proxy.stats("gen").gauges["parked_embeddings"] == 0, "parked ones given back")
        gen = proxy.stats("gen")
        assert gen.counters["parked"] >= 5
        assert gen.gauges["encoder_cache_tokens"] == 0 and gen.gauges["pending_embeddings"] == 0
        until(lambda: proxy.stats("enc").gauges["arena_leases"] == 0, "leases given back")
    except Exception:
        print(log_path.read_text()[-4000:])
        raise
    finally:
        proxy.close()
