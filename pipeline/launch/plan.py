"""Launcher options -> one `StageSpec` per process.

Pure: nothing is started and no device is touched; what the plan needs to know
about the host (GPU count, the built-in model's folder) comes in as
`HostFacts`, gathered once by `host_facts`. Stages go on GPUs by a
placement (placement.py: colocated or dedicated; `auto` is resolved by
auto_placement.py before planning). GPUs are never hidden with
CUDA_VISIBLE_DEVICES: every stage sees every device (CUDA IPC between stages
needs the same numbering everywhere) and is told its own with `--device cuda:N`.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pipeline.cpu_threads import threads_per_stage, usable_cpus
from pipeline.launch.mps import MpsConfig
from pipeline.launch.placement import CONCRETE, PLACEMENTS, place_stages
from pipeline.models.shape_configs import SHAPES
from pipeline.transport import ipc_address

ROLES = ("encoder", "generator", "proxy")
MODES = ("epd", "aggregated")
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("float32", "bfloat16", "float16")
MPS_MODES = ("auto", "on", "off")
ENCODER_PRIORITIES = ("normal", "below-normal")

# Flags the plan sets itself. Passing one through --stage-arg would silently
# win over the plan (argparse keeps the last value), e.g. two stages on one GPU.
MANAGED_FLAGS = {
    "encoder": frozenset({"--address", "--instance", "--model", "--model-id", "--device", "--dtype",
                          "--random-weights", "--yield-to-prefill", "--yield-max-ms"}),
    "generator": frozenset({"--address", "--instance", "--model", "--device", "--dtype", "--mode",
                            "--encoders", "--random-weights", "--prefill-signal"}),
    "proxy": frozenset({"--host", "--port", "--address", "--model", "--model-id", "--encoders",
                        "--generators", "--mode", "--drain-timeout"}),
}

# Generators size their KV cache from a share of their GPU's memory
# (--gpu-memory-utilization, 0.9 alone on a GPU). Where stages share a GPU
# the plan splits that share: each encoder there keeps ENCODER_GPU_SHARE of
# it (weights, arena, vision activations: a 3B-class tower with a 4 GiB
# arena needs about 7 GiB, a tenth of an 80 GiB GPU), the generators split
# the rest evenly. An operator's own --gpu-memory-utilization wins.
GPU_SHARE = 0.9
ENCODER_GPU_SHARE = 0.1

# torch numbers GPUs fastest-first by default, nvidia-smi by PCI bus; --gpus
# takes the numbers an operator reads in nvidia-smi, and every stage must agree.
CUDA_ENV = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


class LaunchError(ValueError):
    """A bad launcher option; the message is one line naming the option."""


@dataclass(frozen=True)
class LaunchOptions:
    """What bin/epd-launch was asked for. Validated on construction."""

    encoders: int
    generators: int
    run_dir: Path  # private 0700 folder for the stages' ipc:// sockets
    model: Path | None = None  # None: the built-in tiny model
    model_id: str | None = None  # None: the model folder's name
    host: str = "127.0.0.1"
    port: int = 8000
    mode: str = "epd"
    dtype: str | None = None  # None: each stage's default for its device
    device: str = "auto"
    gpus: tuple[int, ...] | None = None  # None: every visible GPU
    stage_args: tuple[tuple[str, str], ...] = ()  # (role, extra flag) in order
    python: str = sys.executable
    random_weights: str | None = None  # a shape name: random weights, the shape's weightless folder
    drain_timeout: float = 30.0  # the proxy's, on stop: seconds for the requests in flight to finish
    placement: str = "auto"  # colocated, dedicated, or auto (the planner's pick)
    mps: str = "auto"  # a private MPS daemon: auto (where stages share a GPU), on, off
    encoder_sm_percent: int | None = None  # CUDA_MPS_ACTIVE_THREAD_PERCENTAGE for encoders
    encoder_priority: str = "normal"  # or "below-normal": CUDA_MPS_CLIENT_PRIORITY=1 for encoders
    encoder_yield_ms: float | None = None  # hold an encoder's forwards while a generator on its GPU prefills
    profile: Path | None = None  # epd-plan's profile for --placement auto (else the cached one)

    def __post_init__(self) -> None:
        _check_choice("--mode", self.mode, MODES)
        _check_choice("--placement", self.placement, PLACEMENTS)
        _check_choice("--mps", self.mps, MPS_MODES)
        if self.encoder_sm_percent is not None:
            if not 1 <= self.encoder_sm_percent <= 100:
                raise LaunchError(f"--encoder-sm-percent must be in 1..100 (got {self.encoder_sm_percent})")
            if self.mps == "off":
                raise LaunchError("--encoder-sm-percent needs MPS (it is MPS's per-client SM share); drop --mps off")
        _check_choice("--encoder-priority", self.encoder_priority, ENCODER_PRIORITIES)
        if self.encoder_yield_ms is not None and not self.encoder_yield_ms > 0:
            raise LaunchError(f"--encoder-yield-ms must be > 0 (got {self.encoder_yield_ms:g})")
        if self.encoder_priority != "normal" and self.mps == "off":
            raise LaunchError("--encoder-priority needs MPS (it is MPS's client priority); drop --mps off")
        _check_choice("--device", self.device, DEVICES)
        if self.dtype is not None:
            _check_choice("--dtype", self.dtype, DTYPES)
        if self.generators < 1:
            raise LaunchError(f"--generators must be at least 1 (got {self.generators})")
        if self.mode == "epd" and self.encoders < 1:
            raise LaunchError(f"--encoders must be at least 1 in epd mode (got {self.encoders}); "
                              "use --mode aggregated to serve without encoders")
        if self.mode == "aggregated" and self.encoders != 0:
            raise LaunchError(f"--encoders must be 0 with --mode aggregated (got {self.encoders}): "
                              "generators encode images themselves")
        if not self.drain_timeout >= 0:   # also false for nan
            raise LaunchError(f"--drain-timeout must be >= 0 seconds (got {self.drain_timeout})")
        if not 1 <= self.port <= 65535:
            raise LaunchError(f"--port must be in 1..65535 (got {self.port})")
        if self.model_id is not None and not self.model_id.strip():
            raise LaunchError("--model-id must not be empty")
        self._check_gpus()
        self._check_random_weights()
        for role, arg in self.stage_args:
            _check_stage_arg(role, arg)

    def _check_random_weights(self) -> None:
        if self.random_weights is None:
            return
        _check_choice("--random-weights", self.random_weights, tuple(SHAPES))
        if self.model is not None:
            raise LaunchError("--model cannot be combined with --random-weights: "
                              "the shape's weightless folder is every stage's model")

    def _check_gpus(self) -> None:
        if self.gpus is None:
            return
        if self.device == "cpu":
            raise LaunchError("--gpus cannot be combined with --device cpu")
        if not self.gpus:
            raise LaunchError("--gpus must name at least one GPU")
        if any(g < 0 for g in self.gpus) or len(set(self.gpus)) != len(self.gpus):
            raise LaunchError(f"--gpus must be distinct GPU numbers >= 0 (got {list(self.gpus)})")


@dataclass(frozen=True)
class HostFacts:
    gpu_count: int
    # The built-in tiny model, or the shape's folder with --random-weights;
    # needed only when LaunchOptions.model is None.
    builtin_model: Path | None = None
    cpus: int = 1  # usable cores, split among the stages that run on the CPU
    gpu_name: str | None = None  # torch's name of the first GPU used (finds a cached profile)


@dataclass(frozen=True)
class StageSpec:
    """One process: `argv` is `program` + `args`; `env` overrides the
    launcher's environment."""

    role: str
    instance: str
    address: str  # the stage's inbox (the proxy's too)
    device: str  # "cpu" or "cuda:N"
    program: tuple[str, ...]
    args: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)

    @property
    def argv(self) -> list[str]:
        return [*self.program, *self.args]


def plan_stages(options: LaunchOptions, facts: HostFacts, placement: str | None = None) -> list[StageSpec]:
    """Encoders, then generators, then the proxy. `placement`: colocated or
    dedicated (auto_placement.py resolves --placement auto); None takes
    the options' own, colocated for auto."""
    model = options.model or facts.builtin_model
    if model is None:
        raise LaunchError("no model folder: pass --model DIR")
    model_id = options.model_id or model.name
    placement = placement or (options.placement if options.placement in CONCRETE else "colocated")
    devices = stage_devices(options, facts, placement)
    env = dict(CUDA_ENV) if any(d.startswith("cuda") for d in devices) else {}
    extra = {role: tuple(arg for r, arg in options.stage_args if r == role) for role in ROLES}
    dtype = ("--dtype", options.dtype) if options.dtype else ()
    weights = ("--random-weights", options.random_weights) if options.random_weights else ()
    encoders = [f"encoder-{i}" for i in range(options.encoders)]
    generators = [f"generator-{i}" for i in range(options.generators)]
    address = {name: ipc_address(name, options.run_dir) for name in [*encoders, *generators, "proxy"]}
    to_encoders = tuple(flag for name in encoders for flag in ("--encoders", address[name]))
    to_generators = tuple(flag for name in generators for flag in ("--generators", address[name]))
    on_cpu = devices.count("cpu")
    threads = {"cpu": ("--cpu-threads", str(threads_per_stage(on_cpu, facts.cpus)))} if on_cpu else {}

    yields = prefill_yield_args(options, dict(zip(encoders, devices)), dict(zip(generators, devices[len(encoders):])))
    specs = []
    for name, device in zip(encoders, devices):
        args = ("--address", address[name], "--instance", name, "--model", str(model),
                "--model-id", model_id, "--device", device, *dtype, *weights, *threads.get(device, ()),
                *yields.get(name, ()), *extra["encoder"])
        specs.append(_spec(options, "encoder", name, address[name], device, args, env))
    shares = generator_memory_shares(devices[:len(encoders)], devices[len(encoders):], extra["generator"])
    for name, device, share in zip(generators, devices[len(encoders):], shares):
        args = ("--address", address[name], "--instance", name, "--model", str(model),
                "--device", device, *dtype, *weights, "--mode", options.mode, *to_encoders,
                *share, *threads.get(device, ()), *yields.get(name, ()), *extra["generator"])
        specs.append(_spec(options, "generator", name, address[name], device, args, env))
    args = ("--host", options.host, "--port", str(options.port), "--address", address["proxy"],
            "--model", str(model), "--model-id", model_id, "--mode", options.mode, *to_encoders,
            *to_generators, "--drain-timeout", f"{options.drain_timeout:g}", *extra["proxy"])
    specs.append(_spec(options, "proxy", "proxy", address["proxy"], "cpu", args, {}))
    return specs


def prefill_yield_args(options: LaunchOptions, encoders: dict[str, str],
                       generators: dict[str, str]) -> dict[str, tuple[str, ...]]:
    """With --encoder-yield-ms, stage -> its flags: each generator that shares
    a GPU with an encoder sets a signal file in the run folder while it
    prefills, and each encoder there holds its forwards on those files
    (pipeline/prefill_signal.py). Nothing on the CPU or for a stage alone on its GPU."""
    if options.encoder_yield_ms is None:
        return {}
    signal = {name: options.run_dir / f"{name}.prefill" for name in generators}
    out: dict[str, tuple[str, ...]] = {}
    for encoder, device in encoders.items():
        beside = [name for name, d in generators.items() if d == device and device.startswith("cuda")]
        if beside:
            out[encoder] = (*(flag for name in beside for flag in ("--yield-to-prefill", str(signal[name]))),
                            "--yield-max-ms", f"{options.encoder_yield_ms:g}")
            out.update({name: ("--prefill-signal", str(signal[name])) for name in beside})
    return out


def prefill_signal_file(spec: StageSpec) -> Path | None:
    """The signal file a generator was given by prefill_yield_args, if any
    (the supervisor removes it once the stack has stopped)."""
    args = list(spec.args)
    if "--prefill-signal" not in args[:-1]:
        return None
    return Path(args[args.index("--prefill-signal") + 1])


def stage_devices(options: LaunchOptions, facts: HostFacts, placement: str) -> list[str]:
    """The device of each model stage (encoders first)."""
    if not _uses_cuda(options, facts):
        return ["cpu"] * (options.encoders + options.generators)
    gpus = plan_gpus(options, facts)
    return [f"cuda:{gpu}" for gpu in place_stages(options.encoders, options.generators, gpus, placement)]


def plan_gpus(options: LaunchOptions, facts: HostFacts) -> tuple[int, ...]:
    """The GPUs the stages go on: --gpus, checked, or every visible one."""
    gpus = options.gpus if options.gpus is not None else tuple(range(facts.gpu_count))
    if not gpus:
        raise LaunchError("--device cuda: no CUDA GPU is visible (torch.cuda.device_count() is 0)")
    missing = [g for g in gpus if g >= facts.gpu_count]
    if missing:
        raise LaunchError(f"--gpus {missing[0]}: only {facts.gpu_count} GPU(s) are visible "
                          f"(numbers 0..{facts.gpu_count - 1})")
    return gpus


def uses_cuda(options: LaunchOptions, facts: HostFacts) -> bool:
    return _uses_cuda(options, facts)


def generator_memory_shares(encoder_devices: list[str], generator_devices: list[str],
                            generator_args: tuple[str, ...]) -> list[tuple[str, ...]]:
    """Per generator, the --gpu-memory-utilization flag that splits a shared
    GPU (see GPU_SHARE), or nothing: alone on its GPU, on the CPU, or when
    the operator set the flag."""
    if any(arg.split("=")[0] == "--gpu-memory-utilization" for arg in generator_args):
        return [()] * len(generator_devices)
    shares = []
    for device in generator_devices:
        encoders, generators = encoder_devices.count(device), generator_devices.count(device)
        if not device.startswith("cuda") or encoders + generators == 1:
            shares.append(())
            continue
        share = (GPU_SHARE - ENCODER_GPU_SHARE * encoders) / generators
        if share <= 0:
            raise LaunchError(f"{device} holds {encoders} encoders beside a generator: no memory left for "
                              f"its KV cache; use more GPUs (--gpus) or fewer stages")
        shares.append((f"--gpu-memory-utilization={share:.3f}",))
    return shares


def shared_gpus(specs: list[StageSpec]) -> dict[str, list[str]]:
    """GPU -> instances, for GPUs that hold more than one stage (an operator
    wants MPS there)."""
    by_device: dict[str, list[str]] = {}
    for spec in specs:
        if spec.device.startswith("cuda"):
            by_device.setdefault(spec.device, []).append(spec.instance)
    return {device: names for device, names in by_device.items() if len(names) > 1}


def mps_config(options: LaunchOptions, specs: list[StageSpec], run_dir: Path) -> MpsConfig | None:
    """The private MPS daemon the supervisor runs, or None: --mps off, no
    stage on a GPU, or (auto) no GPU shared by two stages. Every CUDA stage
    is its client (CUDA IPC between them then stays within one daemon)."""
    cuda = [s for s in specs if s.device.startswith("cuda")]
    shared = shared_gpus(specs)
    if options.mps == "off" or not cuda or (options.mps == "auto" and not shared):
        if options.mps == "on" and not cuda:
            raise LaunchError("--mps on: no stage runs on a GPU")
        return None
    encoders = frozenset(s.instance for s in cuda if s.role == "encoder")
    return MpsConfig(run_dir / "mps", frozenset(s.instance for s in cuda), required=options.mps == "on",
                     encoder_sm_percent=options.encoder_sm_percent,
                     encoder_below_normal=options.encoder_priority == "below-normal", encoders=encoders,
                     shared=tuple(shared))


def http_url(host: str, port: int, path: str, *, for_client: bool = False, tls: bool = False) -> str:
    """`for_client`: a wildcard bind address becomes loopback, so the
    launcher can poll a proxy listening on every interface; `tls`: https."""
    if for_client and host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif for_client and host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    return f"{'https' if tls else 'http'}://{host}:{port}{path}"


def host_facts(options: LaunchOptions) -> HostFacts:
    """Look at the host only as far as the options need: torch is imported
    only when GPUs may be used, the tiny model (or the random shape's folder)
    is written only when served."""
    gpu_count = 0
    if options.device == "cuda" or options.gpus is not None or (
            options.device == "auto" and _names_a_real_model(options)):
        import torch

        gpu_count = torch.cuda.device_count()
    builtin = None
    if options.random_weights is not None:
        from pipeline.models.shape_folder import shape_model_dir

        builtin = shape_model_dir(options.random_weights)
    elif options.model is None:
        from pipeline.models.tiny import default_model_dir

        builtin = default_model_dir()
    gpu_name = None
    if gpu_count:
        import torch

        first = options.gpus[0] if options.gpus else 0
        gpu_name = torch.cuda.get_device_name(first) if first < gpu_count else None
    return HostFacts(gpu_count, builtin, usable_cpus(), gpu_name)


def _uses_cuda(options: LaunchOptions, facts: HostFacts) -> bool:
    if options.device == "cuda" or options.gpus is not None:
        return True
    if options.device == "cpu":
        return False
    # auto: the built-in tiny model is a CPU smoke test; a real checkpoint
    # (or a real-size random shape) goes to the GPUs when there are any.
    return _names_a_real_model(options) and facts.gpu_count > 0


def _names_a_real_model(options: LaunchOptions) -> bool:
    return options.model is not None or options.random_weights is not None


def _spec(options: LaunchOptions, role: str, name: str, address: str, device: str,
          args: tuple[str, ...], env: Mapping[str, str]) -> StageSpec:
    return StageSpec(role, name, address, device, (options.python, "-m", f"stages.{role}"),
                     tuple(args), dict(env))


def _check_choice(option: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise LaunchError(f"{option} must be one of {', '.join(allowed)} (got {value!r})")


def _check_stage_arg(role: str, arg: str) -> None:
    if role not in ROLES:
        raise LaunchError(f"--stage-arg {role}={arg}: role must be one of {', '.join(ROLES)}")
    if not arg:
        raise LaunchError(f"--stage-arg {role}=: the flag is empty")
    flag = arg.split("=", 1)[0]
    if flag in MANAGED_FLAGS[role]:
        raise LaunchError(f"--stage-arg {role}={arg}: {flag} is set by the launcher; "
                          "use the launcher's own option")
