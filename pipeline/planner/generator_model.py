"""One generator under a steady load: the capacity planner's model of its
steps (capacity.py asks it at each rate it tries).

At r requests/s of P prompt tokens and O output tokens, with B sequences
decoding, the generator runs two kinds of step (engine/scheduler.py):
- Mixed steps: a chunk of k prompt tokens with the B decodes, one token
  each. The decodes ride through the chunk's weight reads, so a mixed step
  costs prefill(k) + rows(B): rows is the batch-dependent part of the decode
  curve (the decodes' KV reads), scaled from the profile's context to the
  serving one (P + O/2 tokens, a sequence halfway through its output). In
  aggregated mode it also runs the vision forwards of the images in its
  chunk, cut into pieces as the stages cut them.
- Decode-only steps of d(B) in the time the mixed steps leave.
Every step advances every sequence, so TPOT = 1 / (steps a second) and,
by Little's law, B = r * O * TPOT.

A prompt runs in the next step, one prompt a chunk. When mixed steps of one
prompt would fill the time, prompts wait and chunks grow until the mixed
steps just fit, up to the budget the decodes leave (N - B); past that the
generator falls behind. (session 15 in docs/benchmarks.md: under load
almost every step is a mixed step of a full chunk; the model this replaces
charged a whole decode step on top of every prefill and over-predicted
aggregated by up to 30%.)

TTFT is the P99 wait of an M/M/1 queue whose server is the prompt
throughput at full chunks, plus the prompt's own chunks. On a GPU with
encoders, the prefill and decode curves are read at the duty of the
profile's vision load that presses as hard as those encoders' work
(profile.vision_load_duty); the rows are read alone: they are
memory-bound, the work MPS overlaps with a compute-bound vision forward.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from pipeline.models.vision_graphs import plan_pieces
from pipeline.planner.profile import Profile, decode_curve, prefill_line, vision_curve

ITERATIONS = 400
MAX_STEP_S = 60.0  # a step this long means the fixed point diverged


@dataclass(frozen=True)
class GeneratorLoad:
    """What one generator serves and the costs it pays, already split by
    how many generators share its GPU (`crowd`)."""

    rate: float  # requests/s to this generator
    prompt_tokens: int
    output_len: int
    images: int  # per request
    image_tokens: int
    inline_vision: bool  # aggregated: vision forwards run inside its steps
    crowd: int  # generators on its GPU
    encoder_share: float  # the vision load's duty that presses on it as its GPU's encoders do (0 to 1)


def vision_pieces_s(forward: Callable[[float], float], graphs: int, images: float) -> float:
    """Vision seconds for `images` images of one size, run as the stages run
    them: power-of-two graph pieces of at most `graphs` images when the
    stages capture graphs (models/vision_graphs.py), one forward otherwise;
    `forward` is the forward's time by batch (profile.vision_curve). A
    fractional count blends the two whole counts around it."""
    def whole(count: int) -> float:
        if count == 0:
            return 0.0
        if graphs < 1:
            return forward(count)
        pieces = plan_pieces([(1, 1, 1)] * count, graphs)   # one grid: only the sizes matter
        return sum(forward(len(indices)) for _, indices in pieces)
    low = math.floor(images)
    return (1 - (images - low)) * whole(low) + (images - low) * whole(low + 1)


def serve(profile: Profile, load: GeneratorLoad) -> dict:
    """The generator's steady state: TPOT (`step_s`), the decode batch, the
    share of its time in mixed steps (`busy`), its chunk and TTFT; `failed`
    names what breaks ("generator": it falls behind; "max_num_seqs")."""
    costs = _Costs(profile, load)
    budget = profile.limits.max_num_batched_tokens
    tpot, found = costs.decode_only(1), {}
    for _ in range(ITERATIONS):
        batch = load.rate * load.output_len * tpot
        found = costs.steps(batch, budget - batch, found.get("chunk"))
        if found.get("failed"):
            return found
        new = found["step_s"]
        converged = abs(new - tpot) <= 1e-9 * max(1.0, new)
        tpot = (tpot + new) / 2   # damped: the batch and the step feed each other
        if converged or tpot > MAX_STEP_S:
            break
    if not converged:
        return {**found, "failed": "generator"}
    if found["decode_batch"] > profile.limits.max_num_seqs:
        return {**found, "failed": "max_num_seqs"}
    return {**found, "ttft_s": costs.ttft_s(found)}


class _Costs:
    """The load's step costs, the profile's curves read once."""

    def __init__(self, profile: Profile, load: GeneratorLoad) -> None:
        self.profile, self.load = profile, load
        share, crowd = load.encoder_share, load.crowd
        intercept, per_token = prefill_line(profile, share)
        self.prefill_fixed, self.per_token = crowd * intercept, crowd * per_token
        self.context_scale = (load.prompt_tokens + load.output_len / 2) / profile.decode_context_len
        self.share = share
        self.decode_alone, self.decode_beside = decode_curve(profile), decode_curve(profile, share)
        self.first_alone, self.first_beside = self.decode_alone(1), self.decode_beside(1)
        self.vision = vision_curve(profile, load.image_tokens)

    def decode_only(self, batch: float) -> float:
        grows = self.decode_beside(batch) - self.first_beside
        return self.load.crowd * (self.first_beside + max(0.0, grows) * self.context_scale)

    def rows(self, batch: float) -> float:
        grows = self.decode_alone(batch) - self.first_alone
        return self.load.crowd * max(0.0, grows) * self.context_scale

    def vision_per_image(self, images_per_chunk: float) -> float:
        load = self.load
        if not load.inline_vision or load.images == 0:
            return 0.0
        per_step = max(1.0, min(self.profile.limits.local_encode_tokens // load.image_tokens, images_per_chunk))
        return load.crowd * vision_pieces_s(self.vision, self.profile.vision_graphs, per_step) / per_step

    def steps(self, batch: float, room: float, last_chunk: float | None) -> dict:
        """The steps a second at this decode batch, with `room` prompt tokens
        a step; the chunk k solves (r*P/k) * mixed(k) = 1 where mixed steps of
        one prompt would overfill the time. The vision pieces are cut for
        the last iteration's chunk (the fixed point settles both)."""
        load, r, P = self.load, self.load.rate, self.load.prompt_tokens
        if room < 1:
            return {"failed": "generator"}
        vision = self.vision_per_image(load.images * min(last_chunk or P, room) / P)
        fixed = self.prefill_fixed + self.rows(batch)
        variable = r * P * self.per_token + r * load.images * vision   # share of the time, whatever k is
        if variable >= 1:
            return {"failed": "generator", "busy": 1.0}
        def mixed_step_s(chunk: float) -> float:
            return fixed + chunk * self.per_token + load.images * chunk / P * vision

        chunk = min(room, max(min(P, room), r * P * fixed / (1 - variable)))
        mixed_s = mixed_step_s(chunk)
        mixed = r * P / chunk   # mixed steps a second
        busy = mixed * mixed_s
        if busy > 1 + 1e-9:
            return {"failed": "generator", "busy": 1.0}
        step = 1 / (mixed + max(0.0, 1 - busy) / self.decode_only(batch))
        full = r * P / room * mixed_step_s(room)   # the share of the time full chunks would take
        return {"step_s": step, "decode_batch": batch, "busy": min(1.0, busy), "chunk": chunk,
                "mixed_step_s": mixed_s, "prompt_load": full, "encoder_duty": self.share}

    def ttft_s(self, found: dict) -> float:
        """P99 wait for the prompt server (its load: the share of the time
        full chunks would take), then the prompt's own chunks."""
        load = self.load
        rho = found["prompt_load"]
        if rho >= 1:
            return math.inf
        service = rho / load.rate   # a request's mixed-step seconds at full chunks
        wait = service / (1 - rho) * math.log(100 * rho) if rho > 0.01 else 0.0
        return wait + math.ceil(load.prompt_tokens / found["chunk"]) * found["mixed_step_s"]
