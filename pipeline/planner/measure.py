"""Measuring a box for the planner: the work of each stage, timed alone and
beside the other kind of work on the same device (bin/epd-plan --profile-out).

One process holds the model (vision tower and language model) and times:
vision forwards by image size and batch; decode steps by batch; prefill-only
steps by prompt length, all through the engine and forward the stages run.
For "beside", a child process (pipeline/planner/load.py) keeps the device
busy with the other kind of work while the same figures are timed again:
vision beside a generator's mixed steps, the generator's steps beside a
vision loop; once with the child working back to back and once busy half
the time, since serving runs neither side flat out (measured on an H200: a
decode step beside a vision loop that never paused took 7-8x its time
alone, beside the serving encoder, busy 0.6-0.7, 1.2-1.6x). On a GPU the
caller puts both under one MPS daemon.
"""

from __future__ import annotations

import logging
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from pipeline.engine.engine import Engine, EngineConfig
from pipeline.sampling_params import SamplingParams
from pipeline.models.stage_model import load_stage_model, stage_model_dir
from pipeline.models.vision_flags import fuse_vision_tower
from pipeline.models.vision_graphs import vision_forward
from pipeline.planner.profile import (
    FORMAT, DecodePoint, EngineLimits, ImageGeometry, PrefillPoint, Profile, VisionPoint)
from pipeline.processing.image import ImageProcessorConfig, image_grid_thw, num_visual_tokens, preprocess_images
from pipeline.processing.processor import MultimodalPrompt
from pipeline.processing.tokenizer import Tokenizer

log = logging.getLogger("epd.plan")
READY = "epd-plan-load ready"  # the load child's line once its loop runs
PROGRESS = "epd-plan-load progress"  # with --report-every: units done, seconds since READY
DECODE_STEPS_PER_SAMPLE = 4   # run back to back; the drain at a sample's ends costs 1/4 of a step's overlap


@dataclass(frozen=True)
class MeasureSettings:
    model: Path | None  # None: the built-in tiny model (or the shape's folder)
    random_weights: str | None
    model_id: str
    device: str  # "cpu" or "cuda:N"
    dtype: str
    image_sizes: tuple[tuple[int, int], ...] = ((640, 640),)  # (width, height)
    vision_batches: tuple[int, ...] = (1, 4, 16)
    decode_batches: tuple[int, ...] = (1, 8, 32, 64)
    prefill_tokens: tuple[int, ...] = (512, 2048)
    context_len: int = 1024  # prompt tokens of each decoding sequence
    repeats: int = 8
    vision_graphs: int = 0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    encoder_max_batch_tokens: int = 16384
    local_encode_tokens: int = 8192
    kv_cache_mib: int = 4096
    beside: bool = True
    half_duty: bool = True  # also beside a load process busy half the time
    beside_wall_s: float = 2.0  # each beside figure samples at least this long
    mps: bool = False  # the caller runs this process and the child under MPS
    load_timeout_s: float = 300.0


class Box:
    """The model as the stages run it, and the means to time its work."""

    def __init__(self, settings: MeasureSettings, vision: bool = True, engine: bool = True) -> None:
        self.settings = settings
        self.device = torch.device(settings.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.model_dir = stage_model_dir(settings.model, settings.random_weights)
        part = None if vision and engine else "visual" if vision else "language"
        model = load_stage_model(self.model_dir, settings.random_weights, settings.dtype, self.device, part=part)
        self.image_config = ImageProcessorConfig.from_checkpoint(self.model_dir)
        self.vision = self.engine = None
        if vision:
            tower = model if part == "visual" else model.visual
            fuse_vision_tower(tower, self.device)
            grids = [image_grid_thw(h, w, self.image_config) for w, h in settings.image_sizes]
            self.vision = vision_forward(tower, self.device, settings.vision_graphs, grids)
        if engine:
            config = EngineConfig(settings.max_num_batched_tokens, settings.max_num_seqs,
                                  kv_cache_bytes=settings.kv_cache_mib << 20,
                                  capture_decode_len=max(4096, settings.context_len + 256))
            self.engine = Engine(model, Tokenizer.from_checkpoint(self.model_dir), config, self.device)
            self.vocab = min(model.spec.language.vocab_size, 150000)
        self._ids = 0

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def time_s(self, work: Callable[[], object], repeats: int, statistic=np.median, warmup: int = 2,
               min_wall_s: float = 0.0) -> float:
        """`statistic` of the timings of `work`: at least `repeats` of them,
        and (min_wall_s) as many as fill that many seconds, each after a
        random pause of up to a millisecond: beside a load that works and
        idles in turn, samples must fall at every phase of its cycle."""
        for _ in range(warmup):
            work()
        times: list[float] = []
        started_all = time.perf_counter()
        rng = np.random.default_rng(0)
        while len(times) < repeats or (time.perf_counter() - started_all < min_wall_s and len(times) < 5000):
            if min_wall_s:
                time.sleep(rng.uniform(0, 1e-3))
            self.sync()
            started = time.perf_counter()
            work()
            self.sync()
            times.append(time.perf_counter() - started)
        return float(statistic(times))

    # ---- vision

    def vision_input(self, width: int, height: int, batch: int):
        rng = np.random.default_rng(width * 7 + height)
        image = Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))
        pixels, grids = preprocess_images([image] * batch, self.image_config)
        # float32 pixels, as the encoder hands them to the tower
        return pixels.to(self.device), [tuple(g) for g in grids.tolist()]

    def vision_s(self, width: int, height: int, batch: int, repeats: int, statistic=np.median,
                 min_wall_s: float = 0.0) -> float:
        pixels, grids = self.vision_input(width, height, batch)

        def forward():
            with torch.inference_mode():
                self.vision(pixels, grids)
        return self.time_s(forward, repeats, statistic, min_wall_s=min_wall_s)

    # ---- language model

    def prompt(self, length: int) -> MultimodalPrompt:
        self._ids += 1
        ids = np.random.default_rng(self._ids).integers(0, self.vocab, length)
        return MultimodalPrompt([int(x) for x in ids], [], [])

    def add(self, length: int, max_tokens: int) -> str:
        request_id = f"plan-{self._ids}"
        self.engine.add_request(request_id, self.prompt(length), [], SamplingParams(max_tokens=max_tokens,
                                                                                    ignore_eos=True))
        return request_id

    def decode_s(self, batch: int, repeats: int, statistic=np.median, min_wall_s: float = 0.0) -> float:
        """A decode step with `batch` sequences of context_len tokens. Each
        sample times DECODE_STEPS_PER_SAMPLE steps in a row: the engine plans
        and launches a decode step while the last one's tokens are read
        (engine/ahead.py), so steps timed one at a time, with the device
        drained around each, would not show the overlap that serving gets."""
        ids = [self.add(self.settings.context_len, 10_000) for _ in range(batch)]
        sampled: set[str] = set()
        while len(sampled) < batch:  # prefill them all: each has its first token
            sampled.update(out.request_id for out in self.engine.step())

        def steps():
            for _ in range(DECODE_STEPS_PER_SAMPLE):
                self.engine.step()
        seconds = self.time_s(steps, repeats, statistic, min_wall_s=min_wall_s) / DECODE_STEPS_PER_SAMPLE
        for request_id in ids:
            self.engine.abort(request_id)
        return seconds

    def prefill_s(self, tokens: int, repeats: int, statistic=np.median, min_wall_s: float = 0.0) -> float:
        """A step that prefills one new prompt of `tokens` tokens on an idle engine."""
        def step():
            request_id = self.add(tokens, 1)
            self.engine.step()
            self.engine.abort(request_id)
        return self.time_s(step, repeats, statistic, min_wall_s=min_wall_s)


def measure_box(settings: MeasureSettings, say: Callable[[str], None] = print) -> Profile:
    box = Box(settings)
    s = settings
    say(f"epd-plan: timing {s.device} alone")
    vision = {(w, h, b): box.vision_s(w, h, b, s.repeats) for w, h in s.image_sizes for b in s.vision_batches}
    decode = {b: box.decode_s(b, s.repeats) for b in s.decode_batches}
    prefill = {t: box.prefill_s(t, s.repeats) for t in s.prefill_tokens}
    # Beside a load that pauses, one timing lands in its work or in its
    # pause: the mean over samples spread across its cycles (at least
    # beside_wall_s of them) is the expected cost. A first profile timed 6
    # back-to-back decode steps within one pause of a half-duty vision
    # loop, and read no interference at all.
    beside: dict = {}  # duty -> (vision, decode, prefill) timed beside a load of that duty
    duties = () if not s.beside else (1.0, 0.5) if s.half_duty else (1.0,)
    n, wall = 2 * s.repeats, s.beside_wall_s
    for duty in duties:
        say(f"epd-plan: timing vision beside a generator's steps (busy {duty:.0%} of the time)")
        with load_process(s, "generator", duty):
            vision_beside = {key: box.vision_s(*key, n, np.mean, wall) for key in vision}
        say(f"epd-plan: timing the generator's steps beside a vision loop (busy {duty:.0%} of the time)")
        with load_process(s, "vision", duty):
            beside[duty] = (vision_beside, {b: box.decode_s(b, n, np.mean, wall) for b in decode},
                            {t: box.prefill_s(t, n, np.mean, wall) for t in prefill})

    def at(duty: float, part: int, key):
        return beside[duty][part].get(key) if duty in beside else None
    return Profile(
        format=FORMAT, model_id=s.model_id, device_name=device_name(box.device),
        gpu_count=torch.cuda.device_count() if box.device.type == "cuda" else 0, dtype=s.dtype, mps=s.mps,
        vision_graphs=s.vision_graphs, decode_context_len=s.context_len,
        limits=EngineLimits(s.max_num_batched_tokens, s.max_num_seqs, s.encoder_max_batch_tokens,
                            s.local_encode_tokens),
        image=ImageGeometry(box.image_config.patch_size, box.image_config.merge_size,
                            box.image_config.min_pixels, box.image_config.max_pixels),
        vision=[VisionPoint(w, h, num_visual_tokens(h, w, box.image_config), b, t, at(1.0, 0, (w, h, b)),
                            at(0.5, 0, (w, h, b))) for (w, h, b), t in vision.items()],
        decode=[DecodePoint(b, t, at(1.0, 1, b), at(0.5, 1, b)) for b, t in decode.items()],
        prefill=[PrefillPoint(n, t, at(1.0, 2, n), at(0.5, 2, n)) for n, t in prefill.items()],
        created=time.strftime("%Y-%m-%dT%H:%M:%S%z"))


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


class load_process:
    """A child keeping the device busy with `role` work ("generator" or
    "vision") while the block runs; waits for its ready line first. Its
    output is drained all along by a thread (a full pipe would stall it)."""

    def __init__(self, settings: MeasureSettings, role: str, duty: float = 1.0) -> None:
        self.settings, self.role, self.duty = settings, role, duty
        self.proc: subprocess.Popen | None = None
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.tail: list[str] = []

    def argv(self) -> list[str]:
        s = self.settings
        argv = [sys.executable, "-m", "pipeline.planner.load", "--role", self.role, "--device", s.device,
                "--dtype", s.dtype, "--width", str(s.image_sizes[0][0]), "--height", str(s.image_sizes[0][1]),
                "--context-len", str(s.context_len), "--vision-graphs", str(s.vision_graphs),
                "--duty", f"{self.duty:g}"]
        if s.model is not None:
            argv += ["--model", str(s.model)]
        if s.random_weights:
            argv += ["--random-weights", s.random_weights]
        return argv

    def __enter__(self) -> "load_process":
        root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        self.proc = subprocess.Popen(self.argv(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env=env, stdin=subprocess.DEVNULL)
        threading.Thread(target=self._drain, name=f"load-{self.role}", daemon=True).start()
        deadline = time.monotonic() + self.settings.load_timeout_s
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            except queue.Empty:
                continue
            if line is None:
                break  # the child exited before it was ready
            if line.startswith(READY):
                return self
        self.__exit__()
        raise RuntimeError(f"the {self.role} load process did not start ({' | '.join(self.tail[-3:]) or 'no output'})")

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.tail = (self.tail + [line.rstrip()])[-20:]
            self.lines.put(line)
        self.lines.put(None)

    def __exit__(self, *exc) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
