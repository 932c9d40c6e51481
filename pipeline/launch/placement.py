"""Which GPU each model stage runs on: the placements, as pure functions.

An encoder is a process, not a GPU. Its vision forwards are compute-bound
bursts and a generator's decode steps a memory-bound loop, so on one GPU
under MPS they overlap (measured on an H200: an encoder beside a generator
served 1.21x the requests of aggregated serving), while an encoder GPU of
its own idles whenever vision is a small share of the work (0.77x on two
GPUs against two aggregated generators). Hence:

- colocated: generators first, one per GPU (round-robin past the GPU
  count), then each encoder on the GPU holding the fewest stages so far
  (ties: fewest encoders, then list order). Every GPU runs a generator
  where there are enough of them; a GPU left free takes an encoder before
  any GPU is shared.
- dedicated: encoders first, then generators, one stage per GPU,
  round-robin when there are fewer GPUs than stages (the layout of the
  reference design, 1 encoder GPU + N generator GPUs).

`auto` is decided elsewhere (the capacity planner, or colocated without a
profile); these functions take only the two concrete placements.
"""

from __future__ import annotations

PLACEMENTS = ("colocated", "dedicated", "auto")
CONCRETE = ("colocated", "dedicated")


def place_stages(encoders: int, generators: int, gpus: tuple[int, ...], placement: str) -> list[int]:
    """The GPU of each stage, encoders first, then generators."""
    if placement not in CONCRETE:
        raise ValueError(f"placement must be one of {', '.join(CONCRETE)} (got {placement!r})")
    if not gpus:
        raise ValueError("no GPUs to place stages on")
    if placement == "dedicated":
        return [gpus[i % len(gpus)] for i in range(encoders + generators)]
    generator_gpus = [gpus[i % len(gpus)] for i in range(generators)]
    stages = {gpu: generator_gpus.count(gpu) for gpu in gpus}
    encoder_count = dict.fromkeys(gpus, 0)
    encoder_gpus = []
    for _ in range(encoders):
        gpu = min(gpus, key=lambda g: (stages[g], encoder_count[g], gpus.index(g)))
        encoder_gpus.append(gpu)
        stages[gpu] += 1
        encoder_count[gpu] += 1
    return encoder_gpus + generator_gpus


def describe(names: list[str], devices: list[str], gpus: tuple[int, ...] = ()) -> str:
    """'cuda:0: encoder-0 + generator-0; cuda:1: generator-1; cuda:2: unused'."""
    by_device: dict[str, list[str]] = {}
    for name, device in zip(names, devices):
        by_device.setdefault(device, []).append(name)
    for gpu in gpus:
        by_device.setdefault(f"cuda:{gpu}", [])
    order = sorted(by_device, key=lambda d: (not d.startswith("cuda"), int(d[5:]) if d[5:].isdigit() else 0))
    return "; ".join(f"{d}: {' + '.join(by_device[d]) or 'unused'}" for d in order)
