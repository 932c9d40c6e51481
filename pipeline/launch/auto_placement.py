"""`bin/epd-launch --placement auto`: colocated or dedicated, for the stage
counts asked for, by the capacity planner's prediction for the workload
flags, from a box profile (--profile, else the one epd-plan cached for this
model on this kind of GPU); colocated when there is none. Either way one
line says what was chosen and why."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.launch.plan import LaunchError, LaunchOptions, HostFacts, plan_gpus, uses_cuda
from pipeline.planner.cache import cached_profile_path
from pipeline.planner.capacity import Layout, Workload, candidate_layouts, plan, predict
from pipeline.planner.profile import ProfileError, image_tokens, load_profile


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
    if path is None or not Path(path).is_file():
        return PlacementChoice("colocated", "auto without a profile: colocated (bin/epd-plan --profile-out FILE "
                                            "measures one; then --profile FILE)")
    try:
        profile = load_profile(path)
    except ProfileError as exc:
        if options.profile is not None:
            raise LaunchError(f"--profile {exc}") from None
        return PlacementChoice("colocated", f"auto: the cached profile is unusable ({exc}); colocated")
    load = Workload(workload.images, image_tokens(profile, *workload.image_size), workload.input_len,
                    workload.output_len, workload.slo_ttft_ms / 1000, workload.slo_tpot_ms / 1000)
    rates = {kind: predict(profile, load, Layout(options.encoders, options.generators, kind, len(gpus)))
             for kind in ("colocated", "dedicated")}
    chosen = max(rates, key=lambda kind: (rates[kind].max_rate, kind == "colocated"))
    _, best = plan(profile, load, candidate_layouts(len(gpus)))
    hint = "" if best.layout.encoders == options.encoders and best.layout.generators == options.generators else (
        f"; for this workload the profile favours {best.layout.name} ({best.max_rate:.1f} req/s)")
    return PlacementChoice(chosen, f"auto from {path}: predicted {rates['colocated'].max_rate:.1f} req/s colocated, "
                                   f"{rates['dedicated'].max_rate:.1f} dedicated for {workload.images} image(s) of "
                                   f"{workload.image_size[0]}x{workload.image_size[1]}, {workload.input_len} text "
                                   f"tokens{hint}")
