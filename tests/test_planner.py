"""The capacity planner's arithmetic (pipeline/planner/capacity.py) against
hand computations, and the profile format (pipeline/planner/profile.py).

Profiles are made in code with curves simple enough to solve by hand; each
expected value is computed here from the formula written beside it, never by
the code under test."""

from __future__ import annotations

import json
import math

import msgspec
import pytest

from planner_helpers import IMAGE_TOKENS, make_profile
from pipeline.planner.capacity import Layout, Workload, candidate_layouts, evaluate, plan, predict
from pipeline.planner.generator_model import vision_pieces_s
from pipeline.planner.profile import (
    FORMAT, Profile, ProfileError, decode_step_s, interpolate, load_profile, prefill_line, save_profile,
    vision_batch_s)

def text_only(input_len: int = 400, output_len: int = 150, slo_tpot_s: float = 0.05,
              slo_ttft_s: float = 2.0) -> Workload:
    return Workload(images=0, image_tokens=1, input_len=input_len, output_len=output_len, slo_ttft_s=slo_ttft_s,
                    slo_tpot_s=slo_tpot_s)


NO_TTFT = 1e6   # a queue of any length meets this TTFT


def one_prompt_chunks_rate(d0: float, d1: float, P: float, t_p: float, O: int, S: float) -> float:
    """Text only, decode curve d(B) = d0 + d1*B timed at the served context,
    prefill t_p a token through the origin: a mixed step is one prompt with
    the decodes, P*t_p + d1*(B - 1) (the decodes add the curve's part that
    grows with B), r of them a second, busy W = r*(P*t_p + d1*(B - 1)); in the
    rest decode-only steps of d(B). TPOT = 1 / (r + (1 - W) / d(B)) with
    B = r*O*TPOT; set TPOT = S and the r**2 terms cancel:
    r = (1 - d0/S) / (P*t_p + d1*(O - 1) - d0)."""
    return (1 - d0 / S) / (P * t_p + d1 * (O - 1) - d0)


# ---- the generator's steps ---------------------------------------------------

@pytest.mark.parametrize("generators, gpus", [(1, 1), (2, 2)])
def test_text_only_tpot_bound_with_a_flat_decode_curve(generators, gpus):
    """d(B) = d0, one prompt a mixed step (one_prompt_chunks_rate with d1 = 0),
    each generator on its own GPU: R = G * r."""
    d0, t_p, S, O = 0.01, 2e-4, 0.05, 150
    load = text_only(output_len=O, slo_tpot_s=S, slo_ttft_s=NO_TTFT)
    P = 400 + 20  # the text plus the chat template's tokens
    assert load.prompt_tokens == P
    r = one_prompt_chunks_rate(d0, 0.0, P, t_p, O, S)   # 10.8 req/s a generator
    assert r * P * t_p < 1   # the mixed steps leave time for decode-only ones
    prediction = predict(make_profile(d0=d0, t_p=t_p), load, Layout(0, generators, "aggregated", gpus))
    assert prediction.bound == "tpot"
    assert prediction.max_rate == pytest.approx(generators * r, rel=0.005)
    generator = prediction.detail["generators"][0]
    assert generator["chunk"] == pytest.approx(P) and generator["busy"] == pytest.approx(r * P * t_p, rel=0.01)
    # At the limit the decode batch r*O*S stays well under max_num_seqs, so TPOT is what binds.
    assert r * O * S < 1024


def test_text_only_tpot_bound_with_a_growing_decode_curve():
    """d(B) = d0 + d1*B, timed at the served context (P + O/2 tokens): one_prompt_chunks_rate."""
    d0, d1, t_p, S, O = 0.01, 2e-4, 1e-4, 0.05, 150
    P = 400 + 20
    r = one_prompt_chunks_rate(d0, d1, P, t_p, O, S)   # 12.9 req/s
    profile = make_profile(d0=d0, d1=d1, t_p=t_p, decode_context_len=P + O // 2)
    prediction = predict(profile, text_only(output_len=O, slo_tpot_s=S, slo_ttft_s=NO_TTFT),
                         Layout(0, 1, "aggregated", 1))
    assert prediction.bound == "tpot"
    assert prediction.max_rate == pytest.approx(r, rel=0.005)
    assert prediction.detail["generators"][0]["decode_batch"] == pytest.approx(r * O * S, rel=0.01)


def test_the_decodes_cost_grows_with_their_context():
    """The decode curve's part that grows with B is KV reads: timed at half
    the served context, it costs twice as much a sequence, as d1 doubled
    timed at the served context would."""
    d0, d1, t_p, S, O, P = 0.01, 1e-4, 1e-4, 0.05, 150, 420
    load = text_only(output_len=O, slo_tpot_s=S, slo_ttft_s=NO_TTFT)
    at_half = predict(make_profile(d0=d0, d1=d1, t_p=t_p, decode_context_len=(P + O // 2) // 2), load,
                      Layout(0, 1, "aggregated", 1))
    # d(B) = d0 + d1 + 2*d1*(B - 1) = (d0 - d1) + 2*d1*B
    assert at_half.max_rate == pytest.approx(one_prompt_chunks_rate(d0 - d1, 2 * d1, P, t_p, O, S), rel=0.01)


def test_prompts_gather_into_larger_chunks_when_single_ones_would_fill_the_time():
    """Prefill a + b*k for a chunk of k (a: the weight reads, paid per
    step): mixed steps of one prompt each would need r*(a + b*P) > 1 of a
    second, so prompts wait and chunks grow until the mixed steps fill it,
    (r*P/k) * (a + b*k) = 1, k = r*P*a / (1 - r*P*b); every step is then a
    mixed one of a/(1 - r*P*b) seconds, so TPOT = S at r = (1 - a/S) / (P*b)
    (the flat decode curve adds nothing a sequence)."""
    a, b, S, O = 0.01, 1e-5, 0.05, 150
    load = text_only(input_len=2000, output_len=O, slo_tpot_s=S, slo_ttft_s=NO_TTFT)
    P = load.prompt_tokens
    r = (1 - a / S) / (P * b)   # 39.6 req/s
    assert r * (a + b * P) > 1   # one prompt a step would not keep up
    prediction = predict(make_profile(d0=0.01, t_p=b, prefill_fixed=a), load, Layout(0, 1, "aggregated", 1))
    assert prediction.bound == "tpot"
    assert prediction.max_rate == pytest.approx(r, rel=0.005)
    generator = prediction.detail["generators"][0]
    assert generator["chunk"] == pytest.approx(r * P * a / (1 - r * P * b), rel=0.01)   # 4,000 tokens
    assert generator["busy"] == pytest.approx(1.0, abs=1e-6)


def test_a_generator_falls_behind_when_full_chunks_do_not_fit():
    """A 2,048-token budget and one output token (B ~ 0): full chunks of
    about 2,048 tokens take a + b*2048 each, so prompts of P tokens keep up
    while r*P*(a + b*2048)/2048 < 1."""
    a, b, budget = 0.01, 1e-5, 2048
    load = text_only(input_len=2000, output_len=1, slo_tpot_s=10.0, slo_ttft_s=NO_TTFT)
    P = load.prompt_tokens
    prediction = predict(make_profile(d0=0.01, t_p=b, prefill_fixed=a, max_num_batched_tokens=budget), load,
                         Layout(0, 1, "aggregated", 1))
    assert prediction.bound == "generator"
    # B = r*1*TPOT is about one sequence, so the room left is between budget - 2 and budget.
    lower, upper = ((room / (P * (a + b * room))) for room in (budget - 2, budget))
    assert lower * 0.999 <= prediction.max_rate <= upper


def ttft_bound_rate(P: int, t_p: float, T: float) -> float:
    """Flat decode curve, one prompt a chunk: full chunks of the budget would
    take rho = r*P*t_p of the time, a request's service is P*t_p, and an
    M/M/1 queue's P99 wait is P*t_p / (1 - rho) * ln(100*rho); then the
    prompt's own step, P*t_p. The rate where that sum is T, by bisection."""
    service = P * t_p

    def ttft(rho: float) -> float:
        return service / (1 - rho) * math.log(100 * rho) + service

    low, high = 0.01, 0.999999   # ttft grows with rho
    for _ in range(100):
        low, high = ((low + high) / 2, high) if ttft((low + high) / 2) < T else (low, (low + high) / 2)
    return low / service


def test_ttft_is_the_p99_wait_for_the_prompt_server():
    load = text_only(slo_tpot_s=10.0, slo_ttft_s=1.0)
    prediction = predict(make_profile(d0=0.01, t_p=1e-4), load, Layout(0, 1, "aggregated", 1))
    assert prediction.bound == "ttft"
    assert prediction.max_rate == pytest.approx(ttft_bound_rate(load.prompt_tokens, 1e-4, 1.0), rel=0.005)


def test_generators_sharing_a_gpu_split_it():
    """Two generators on one GPU each pay twice the costs (2*d0, 2*t_p) at
    half the rate: R = 2 * one_prompt_chunks_rate(2*d0, 0, P, 2*t_p, O, S)."""
    d0, t_p, S, O, P = 0.01, 2e-4, 0.05, 150, 420
    expected = 2 * one_prompt_chunks_rate(2 * d0, 0.0, P, 2 * t_p, O, S)   # 8.1 req/s
    prediction = predict(make_profile(d0=d0, t_p=t_p), text_only(slo_tpot_s=S, slo_ttft_s=NO_TTFT),
                         Layout(0, 2, "aggregated", 1))
    assert prediction.bound == "tpot"
    assert prediction.max_rate == pytest.approx(expected, rel=0.005)


def test_a_slow_encoder_bounds_the_rate():
    """Dedicated 1E+1G on 2 GPUs, T(b) = b*t: batching saves nothing, so the
    encoder keeps up while R*I*t < 1. At the bound it is busy ~1, and its
    batch, I * (lambda*T + exp(-lambda*T)) with lambda = R requests/s, serves
    the arrivals: R*I*T <= batch."""
    images, t = 2, 0.4
    expected = 1 / (images * t)   # 1.25 req/s
    load = Workload(images=images, image_tokens=IMAGE_TOKENS, input_len=400, output_len=150,
                    slo_ttft_s=1e6, slo_tpot_s=0.05)   # a queue of any length meets this TTFT
    profile = make_profile(image_s=t, vision_beside=3.0)   # the encoder's GPU holds no generator: alone times
    prediction = predict(profile, load, Layout(1, 1, "dedicated", 2))
    assert prediction.bound == "encoder"
    assert prediction.max_rate == pytest.approx(expected, rel=0.01)
    encoder = prediction.detail["encoders"][0]
    rate = prediction.max_rate
    forward = encoder["batch"] * t
    assert encoder["batch"] == pytest.approx(images * (rate * forward + math.exp(-rate * forward)), rel=1e-3)
    assert encoder["busy"] > 0.99


def test_a_light_encoder_is_busy_as_long_as_its_work_takes():
    """Far below the bound a forward carries one request (the queue is
    almost always empty at its end), so busy ~ lambda*T(I): the work's share."""
    images, t, rate = 2, 0.01, 1.0   # 2% of the time
    load = Workload(images=images, image_tokens=IMAGE_TOKENS, input_len=10, output_len=2, slo_ttft_s=1e6,
                    slo_tpot_s=10)
    encoder = evaluate(make_profile(image_s=t), load, Layout(1, 1, "dedicated", 2), rate).detail["encoders"][0]
    assert encoder["stable"]
    assert encoder["busy"] == pytest.approx(rate * images * t, rel=0.01)
    assert encoder["batch"] == pytest.approx(images, rel=0.001)


def test_an_encoder_that_bounds_the_rate_is_reported_nearly_busy():
    """Whatever the generator's busy share is taken to be, the verdict and the
    figures reported at the highest rate must agree: an encoder that bounds
    the rate is busy ~1 there (as it is in the dedicated case above)."""
    load = Workload(images=2, image_tokens=IMAGE_TOKENS, input_len=400, output_len=150,
                    slo_ttft_s=1e6, slo_tpot_s=0.05)
    prediction = predict(make_profile(image_s=0.4, vision_beside=3.0), load, Layout(1, 1, "colocated", 1))
    assert prediction.bound == "encoder"
    assert prediction.detail["encoders"][0]["busy"] > 0.95


def test_a_falling_decode_curve_does_not_crash_the_planner():
    """A noisy measurement can time the larger decode batch faster (seen on
    the CPU with batches 1 and 2). The line through d(1) = 3 ms, d(2) = 1 ms
    reaches 0 s at B = 2.5 sequences: at 2 req/s (prefill 0.84 of each step)
    the fixed point's first step, 3 ms / 0.16, carries 5.6 sequences, whose
    decode costs 0 s, so the next step is 0 s; the planner must still answer."""
    data = msgspec.to_builtins(make_profile(t_p=1e-3))
    data["decode"] = [{"batch": 1, "alone_s": 0.003}, {"batch": 2, "alone_s": 0.001}]
    falling = msgspec.convert(data, Profile)
    prediction = predict(falling, text_only(), Layout(0, 1, "aggregated", 1))
    assert prediction.max_rate > 0


def test_two_points_at_one_batch_are_refused_or_read(tmp_path):
    data = msgspec.to_builtins(make_profile())
    data["decode"] = [{"batch": 1, "alone_s": 0.01}, {"batch": 1, "alone_s": 0.02}, {"batch": 8, "alone_s": 0.03}]
    path = tmp_path / "twice.json"
    path.write_text(json.dumps(data))
    try:
        profile = load_profile(path)
    except ProfileError as exc:   # refusing them is one fix
        assert str(path) in str(exc)
        return
    assert 0.01 <= decode_step_s(profile, 1) <= 0.02   # reading them (e.g. their mean) the other


# ---- choosing a layout ------------------------------------------------------

def test_text_only_chooses_aggregated():
    """Without images encoders idle: colocated layouts tie with aggregated
    (then the simplest wins) and dedicated ones lose generators."""
    predictions, chosen = plan(make_profile(), text_only(), candidate_layouts(4))
    assert chosen.layout == Layout(0, 4, "aggregated", 4)
    assert chosen.max_rate == pytest.approx(4 * ttft_bound_rate(420, 1e-4, 2.0), rel=0.005)   # 4 x 21.5
    dedicated = [p for p in predictions if p.layout.placement == "dedicated"]
    assert all(p.max_rate < chosen.max_rate * 0.9 for p in dedicated)


def test_a_vision_heavy_workload_chooses_several_encoders():
    """8 images of 0.05 s each a request, nothing lost beside: one encoder
    caps the box at 1/(8*0.05) = 2.5 req/s, and generators encoding in their
    own steps stretch every step; several encoders beside the generators win."""
    load = Workload(images=8, image_tokens=IMAGE_TOKENS, input_len=400, output_len=150)
    predictions, chosen = plan(make_profile(image_s=0.05), load, candidate_layouts(4))
    assert chosen.layout.encoders > 1
    aggregated = next(p for p in predictions if p.layout.placement == "aggregated")
    one_encoder = [p for p in predictions if p.layout.encoders == 1]
    assert chosen.max_rate > 1.5 * aggregated.max_rate
    assert all(p.max_rate <= 1 / (8 * 0.05) for p in one_encoder)


@pytest.mark.parametrize("gpus, expected", [
    (1, [(0, 1, "aggregated"), (1, 1, "colocated")]),
    (2, [(0, 2, "aggregated"), (1, 2, "colocated"), (2, 2, "colocated"), (1, 1, "dedicated")]),
    (4, [(0, 4, "aggregated"), (1, 4, "colocated"), (2, 4, "colocated"), (3, 4, "colocated"),
         (4, 4, "colocated"), (1, 3, "dedicated"), (2, 2, "dedicated"), (3, 1, "dedicated")]),
    (8, [(0, 8, "aggregated"), *[(e, 8, "colocated") for e in range(1, 9)],
         *[(e, 8 - e, "dedicated") for e in range(1, 8)]]),
])
def test_candidate_layouts(gpus, expected):
    layouts = candidate_layouts(gpus)
    assert [(l.encoders, l.generators, l.placement) for l in layouts] == expected
    assert {l.gpus for l in layouts} == {gpus}


def test_layouts_refuse_inconsistent_counts():
    with pytest.raises(ValueError, match="aggregated"):
        Layout(1, 2, "aggregated", 2)
    with pytest.raises(ValueError, match="aggregated"):
        Layout(0, 2, "colocated", 2)
    with pytest.raises(ValueError, match="placement must be one of"):
        Layout(1, 1, "auto", 2)


# ---- the curves ---------------------------------------------------------------

@pytest.mark.parametrize("points, x, expected", [
    ([(1, 2.0), (3, 6.0)], 2, 4.0),              # inside: on the segment
    ([(1, 2.0), (3, 6.0)], 3, 6.0),              # on a point
    ([(1, 1.0), (2, 3.0), (4, 4.0)], 3, 3.5),    # the right segment of three points
    ([(1, 1.0), (2, 3.0), (4, 4.0)], 8, 6.0),    # beyond the right end: 4 + (8-4) * (4-3)/(4-2)
    ([(2, 3.0), (4, 4.0)], 0, 2.0),              # beyond the left end: 3 - 2 * (4-3)/(4-2)
    ([(1, 1.0), (2, 3.0)], 0, 0.0),              # the line goes below zero: clamped
    ([(1, 1.0), (2, 3.0)], 0.5, 0.5),            # ... and above zero, to the first point's share of its time
    ([(64, 0.267), (128, 0.072)], 512, 0.072),   # a bigger batch timed faster (a busy box): held at the last
    ([(1, 1.0), (2, 4.0)], 4, 8.0),              # steeper past the end than in proportion: 4 * 4/2
    ([(4, 2.0)], 6, 3.0),                        # one point: through the origin, 2 * 6/4
])
def test_interpolate(points, x, expected):
    assert interpolate(points, x) == pytest.approx(expected)


def test_reading_the_profile_curves():
    profile = make_profile(d0=0.01, d1=0.001, t_p=2e-4, image_s=0.03, vision_beside=2.0, generator_beside=1.5)
    assert decode_step_s(profile, 10) == pytest.approx(0.01 + 0.001 * 10)
    assert decode_step_s(profile, 0.2) == pytest.approx(0.011)    # fewer than one: a step of one
    assert decode_step_s(profile, 10, share=1.0) == pytest.approx(1.5 * 0.02)
    assert prefill_line(profile) == pytest.approx((0.0, 2e-4))   # one point: through the origin
    with_fixed = make_profile(t_p=2e-4, prefill_fixed=0.01, generator_beside=1.5)
    assert prefill_line(with_fixed) == pytest.approx((0.01, 2e-4))
    assert prefill_line(with_fixed, share=1.0) == pytest.approx((0.015, 3e-4))
    assert vision_batch_s(profile, IMAGE_TOKENS, 3) == pytest.approx(3 * 0.03)
    assert vision_batch_s(profile, IMAGE_TOKENS // 2, 2) == pytest.approx(0.03)   # by visual tokens
    assert vision_batch_s(profile, IMAGE_TOKENS, 2, share=1.0) == pytest.approx(2 * 0.03 * 2.0)


# ---- the file format ------------------------------------------------------------

def test_profile_round_trip(tmp_path):
    profile = make_profile(d1=3e-4, vision_beside=1.7)
    path = tmp_path / "deep" / "box.json"
    save_profile(profile, path)
    assert load_profile(path) == profile
    assert json.loads(path.read_text())["format"] == FORMAT


def _spoil(data: dict, how: str) -> None:
    if how == "unknown field":
        data["vision"][0]["colour"] = "blue"
    elif how == "unknown top field":
        data["speed"] = 3
    elif how == "format":
        data["format"] = "epd-profile/0"
    elif how == "empty decode":
        data["decode"] = []
    elif how == "negative time":
        data["prefill"][0]["alone_s"] = -0.5
    elif how == "zero beside":
        data["vision"][1]["beside_s"] = 0.0
    elif how == "missing field":
        del data["limits"]["max_num_seqs"]
    elif how == "wrong type":
        data["gpu_count"] = "eight"


@pytest.mark.parametrize("how, words", [
    ("unknown field", "colour"), ("unknown top field", "speed"), ("format", "epd-profile/1"),
    ("empty decode", "decode"), ("negative time", "> 0"), ("zero beside", "> 0"),
    ("missing field", "max_num_seqs"), ("wrong type", "gpu_count"),
])
def test_malformed_profiles_are_refused_naming_the_file(tmp_path, how, words):
    data = msgspec.to_builtins(make_profile())
    _spoil(data, how)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError) as info:
        load_profile(path)
    message = str(info.value)
    assert message.startswith(f"{path}: ") and words in message and "\n" not in message


@pytest.mark.parametrize("text", ["", "not json", "[1, 2]"])
def test_files_that_are_not_profiles_are_refused(tmp_path, text):
    path = tmp_path / "junk.json"
    path.write_text(text)
    with pytest.raises(ProfileError, match="not an EPD profile"):
        load_profile(path)
    with pytest.raises(ProfileError, match="No such file"):
        load_profile(tmp_path / "missing.json")


def test_the_reference_rates_are_finite():
    """A guard on the helper itself: every layout of the default profile
    has a finite, positive rate (an infinite one would hide a broken curve)."""
    predictions, _ = plan(make_profile(), Workload(1, IMAGE_TOKENS, 400, 150), candidate_layouts(2))
    assert all(0 < p.max_rate < math.inf for p in predictions)
