"""`bin/epd-launch --placement auto`: where the stages asked for go, and what
the capacity planner predicts of them for the workload flags, from a box
profile (--profile, else the one epd-plan cached for this model on this
kind of GPU). One line says what was chosen and why.

For given stage counts, colocated and dedicated put the same mix of stages
on each GPU (round-robin spreads them alike; only the GPU numbers differ:
checked for every count up to 12 GPUs and 19 stages of each kind), so auto
places them colocated and the real choice is of the counts: where the
profile predicts more of another layout for this GPU count, the line says
so (e.g. "favours colocated 4E+4G on 4 GPU(s)")."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.launch.plan import LaunchError, LaunchOptions, HostFacts, plan_gpus, uses_cuda
from pipeline.planner.cache import cached_profile_path
from pipeline.planner.capacity import Layout, candidate_layouts, plan, predict
from pipeline.planner.cli import planned_workload
from pipeline.planner.profile import ProfileError, load_profile


@dataclass(frozen=True)
class PlanWorkload:
    """The workload flags of --placement auto."""

    images: int = 1
    image_size: tuple[int, int] = (640, 640)
    input_len: int = 400
    output_len: int = 150
    slo_ttft_ms: float = 2000.0
    slo_tpot_ms: float = 50.0


@dataclass(frozen=True)
class PlacementChoice:
    placement: str  # colocated or dedicated
    reason: str  # for the log line


def choose_placement(options: LaunchOptions, facts: HostFacts, model_id: str,
                     workload: PlanWorkload = PlanWorkload()) -> PlacementChoice:
    if options.placement != "auto":
        return PlacementChoice(options.placement, "as asked (--placement)")
    if not uses_cuda(options, facts):
        return PlacementChoice("colocated", "every stage runs on the CPU")
    gpus = plan_gpus(options, facts)
    if options.mode == "aggregated":
        return PlacementChoice("dedicated", "aggregated mode: one generator per GPU")
    if len(gpus) == 1:
        return PlacementChoice("colocated", "one GPU: every stage shares it")
    path = options.profile or (cached_profile_path(model_id, facts.gpu_name) if facts.gpu_name else None)
    if path is None or (options.profile is None and not Path(path).is_file()):  # a named --profile must exist
        return PlacementChoice("colocated", "auto without a profile: colocated (bin/epd-plan --profile-out FILE "
                                            "measures one; then --profile FILE)")
    try:
        profile = load_profile(path)
    except ProfileError as exc:
        if options.profile is not None:
            raise LaunchError(f"--profile {exc}") from None
        return PlacementChoice("colocated", f"auto: the cached profile is unusable ({exc}); colocated")
    load = planned_workload(profile, workload.images, workload.image_size, workload.input_len,
                            workload.output_len, workload.slo_ttft_ms, workload.slo_tpot_ms)
    asked = predict(profile, load, Layout(options.encoders, options.generators, "colocated", len(gpus)))
    _, best = plan(profile, load, candidate_layouts(len(gpus)))
    same = best.layout.encoders == options.encoders and best.layout.generators == options.generators
    hint = "" if same else f"; for this workload the profile favours {best.layout.name} ({best.max_rate:.1f} req/s)"
    return PlacementChoice("colocated", f"auto from {path}: predicted {asked.max_rate:.1f} req/s (bound: "
                                        f"{asked.bound}) for {workload.images} image(s) of {workload.image_size[0]}x"
                                        f"{workload.image_size[1]}, {workload.input_len} text tokens{hint}")
