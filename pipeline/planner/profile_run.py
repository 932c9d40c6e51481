"""`bin/epd-plan --profile-out FILE`: choose the device; where the beside
timings run on a GPU, start a private MPS daemon and measure in a child
process that is its client (with its load children); measure (measure.py)
and write the profile."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from pipeline.launch.mps import PIPE_VAR, MpsConfig, MpsDaemon, MpsError

CLIENT = "epd-plan"


def profile_main(args: argparse.Namespace, argv: list[str]) -> int:
    say = _printer()
    cuda = args.device == "cuda" or (args.device == "auto" and _names_a_real_model(args) and _has_gpu(args))
    daemon = None
    if cuda and not args.no_beside and args.mps != "off":
        daemon = _start_mps(args.mps == "on", say)
    if daemon is None or not daemon.client_env:
        return _measure_and_write(args, cuda, mps=PIPE_VAR in os.environ, say=say)
    # Our own daemon: the measuring runs in a child, its client. The daemon
    # quits only once its clients are gone, and a CUDA context lives as long
    # as its process; so this process must never become one.
    try:
        child = [sys.executable, str(Path(__file__).resolve().parents[2] / "bin" / "epd-plan"), *argv, "--mps", "off"]
        return subprocess.run(child, env={**os.environ, **daemon.client_env}).returncode
    finally:
        daemon.stop()
        shutil.rmtree(daemon.config.root.parent, ignore_errors=True)


def _measure_and_write(args: argparse.Namespace, cuda: bool, mps: bool, say) -> int:
    from pipeline.planner.cli import write_profile
    from pipeline.planner.measure import MeasureSettings, measure_box

    gpu = args.gpu_list[0] if args.gpu_list else 0
    device = f"cuda:{gpu}" if cuda else "cpu"
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    model_id = args.model_id or _model_folder(args).name
    settings = MeasureSettings(args.model, args.random_weights, model_id, device, dtype,
                               image_sizes=tuple(args.image_sizes), vision_batches=args.vision_batches,
                               decode_batches=args.decode_batches, prefill_tokens=args.prefill_tokens,
                               repeats=args.repeats, vision_graphs=args.vision_graphs, max_num_seqs=args.max_num_seqs,
                               kv_cache_mib=8192 if cuda else 256, beside=not args.no_beside,
                               half_duty=not args.no_half_duty, beside_wall_s=args.beside_wall_s, mps=mps)
    profile = measure_box(settings, say)
    for path in write_profile(profile, args.profile_out):
        say(f"epd-plan: wrote {path}")
    return 0


def _start_mps(required: bool, say) -> MpsDaemon | None:
    """A private daemon (or the operator's, named by CUDA_MPS_PIPE_DIRECTORY,
    whose client_env is then empty); None when none could start and
    `required` is off."""
    root = Path(tempfile.mkdtemp(prefix="epd-plan-")) / "mps"
    daemon = MpsDaemon(MpsConfig(root, frozenset({CLIENT}), required=required),
                       lambda line: say(line.replace("epd-launch:", "epd-plan:", 1)))
    try:
        daemon.start()
    except MpsError as exc:
        root.parent.rmdir()
        if required:
            raise RuntimeError(f"MPS could not start ({exc})") from None
        say(f"epd-plan: warning: MPS could not start ({exc}); the beside timings time-slice the GPU")
        return None
    return daemon


def _printer():
    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)
    return say


def _names_a_real_model(args: argparse.Namespace) -> bool:
    return args.model is not None or args.random_weights is not None


def _has_gpu(args: argparse.Namespace) -> bool:
    # nvidia-smi-free and CUDA-context-free: the driver's device nodes. A CUDA
    # context made here before the MPS daemon would never attach to it.
    return any(Path("/dev").glob("nvidia[0-9]*")) or args.gpu_list is not None


def _model_folder(args: argparse.Namespace) -> Path:
    from pipeline.models.stage_model import stage_model_dir
    return stage_model_dir(args.model, args.random_weights)
