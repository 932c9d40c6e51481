"""The capacity planner's colocated stages: an encoder's forwards read
beside a busy generator, a generator read at the duty of the vision load
that does its encoders' work, half-duty figures, and the encoder's batching
under Poisson arrivals (hand computations, as tests/test_planner.py)."""

from __future__ import annotations

import math

import msgspec
import pytest

from planner_helpers import IMAGE_TOKENS, make_profile
from pipeline.planner.capacity import Layout, Workload, evaluate, predict
from pipeline.planner.profile import DecodePoint, VisionPoint, decode_step_s, vision_load_duty


def test_a_colocated_encoder_pays_its_beside_times():
    """Colocated 1E+1G on 1 GPU beside a busy generator: the same encoder
    bound with T = beside times, R < 1/(I*t*k) for beside = k * alone, at most."""
    images, t, k = 2, 0.4, 3.0
    load = Workload(images=images, image_tokens=IMAGE_TOKENS, input_len=400, output_len=150,
                    slo_ttft_s=1e6, slo_tpot_s=0.05)
    alone = predict(make_profile(image_s=t, vision_beside=k), load, Layout(1, 1, "dedicated", 2))
    beside = predict(make_profile(image_s=t, vision_beside=k), load, Layout(1, 1, "colocated", 1))
    assert beside.bound == "encoder"
    # The blend weights beside by how busy the generator is, so between the two bounds.
    assert 1 / (images * t * k) * 0.99 <= beside.max_rate < alone.max_rate * 0.99



def test_a_profile_timed_on_a_busy_box_still_plans():
    """Found on CI (the suite's workers side by side): epd-plan --profile-out
    timed a 2-image forward at 0.07 s and a 1-image one at 0.27 s. The
    vision load's 8-image forward, read past the end of that falling line,
    came out at zero seconds, and the planner divided by it
    (ZeroDivisionError). Past the end a forward now takes no less than the
    biggest one measured."""
    t = 0.002
    base = make_profile(d0=0.004, t_p=2e-5, image_s=t, generator_beside=2.0)
    profile = msgspec.structs.replace(base, vision=[VisionPoint(448, 448, IMAGE_TOKENS, 1, 0.267, 0.086),
                                                    VisionPoint(448, 448, IMAGE_TOKENS, 2, 0.072, 0.034)])
    assert vision_load_duty(profile, 0.01) == pytest.approx(0.01 * 0.034 / 0.072)
    load = Workload(images=1, image_tokens=IMAGE_TOKENS, input_len=1000, output_len=20, slo_ttft_s=1e6,
                    slo_tpot_s=10)
    result = predict(profile, load, Layout(1, 1, "colocated", 1))
    assert result.max_rate > 0 and math.isfinite(result.max_rate)


def test_the_generator_is_read_at_the_duty_of_the_vision_load_doing_the_encoders_work():
    """Colocated, the generator's costs are read at the duty of the profile's
    vision load (8-image forwards, back to back, each 1.5x its alone time
    beside a generator: 8t of work in 12t) that does the encoder's vision
    work a second, not at the encoder's busy share. Here a 1-image forward
    takes 4x its alone time beside the generator, as small forwards did on
    the H200 (3.8x, against 1.6x at 8 images): at 30 req/s of one image the
    encoder works lambda*t = 0.06 s a second, duty 0.06 * 12t/8t = 0.09,
    while it is busy about twice that, waiting on the GPU."""
    t = 0.002
    base = make_profile(d0=0.004, t_p=2e-5, image_s=t, generator_beside=2.0)
    profile = msgspec.structs.replace(base, vision=[VisionPoint(448, 448, IMAGE_TOKENS, 1, t, 4 * t),
                                                    VisionPoint(448, 448, IMAGE_TOKENS, 8, 8 * t, 12 * t)])
    assert vision_load_duty(profile, 0.1) == pytest.approx(0.15)
    assert vision_load_duty(profile, 0.9) == 1.0   # no more than the load back to back
    load = Workload(images=1, image_tokens=IMAGE_TOKENS, input_len=1000, output_len=20, slo_ttft_s=1e6,
                    slo_tpot_s=10)
    result = evaluate(profile, load, Layout(1, 1, "colocated", 1), 30.0)
    encoder, generator = result.detail["encoders"][0], result.detail["generators"][0]
    assert result.failed is None
    assert encoder["work"] == pytest.approx(30.0 * t)
    assert generator["encoder_duty"] == pytest.approx(0.09)
    assert encoder["busy"] > 2 * generator["encoder_duty"]
    # Text only: no vision work, the generator is read alone.
    text = evaluate(profile, Workload(0, IMAGE_TOKENS, 1000, 20, 1e6, 10), Layout(1, 1, "colocated", 1), 30.0)
    assert text.detail["generators"][0]["encoder_duty"] == 0.0



def test_a_half_duty_figure_bends_the_interference_curve():
    """Read at the other side's busy share: alone at 0, beside at 1, and the
    half-duty figure at 0.5 where measured (else a straight line)."""
    bent = DecodePoint(1, 1.0, 3.0, 1.2)
    straight = DecodePoint(1, 1.0, 3.0)
    base = make_profile()
    for point, expected in ((bent, {0.0: 1.0, 0.25: 1.1, 0.5: 1.2, 0.75: 2.1, 1.0: 3.0}),
                            (straight, {0.0: 1.0, 0.5: 2.0, 1.0: 3.0})):
        profile = msgspec.structs.replace(base, decode=[point])
        for share, seconds in expected.items():
            assert decode_step_s(profile, 1, share=share) == pytest.approx(seconds)



def test_an_encoder_with_a_fixed_cost_per_forward_batches_just_enough():
    """T(b) = a + c*b (a fixed cost per forward, as an eager forward's
    launches), one image a request at lambda = 100/s: one image a forward
    would need lambda*(a + c) = 2.5 s a second. Batching what queued, b =
    lambda*T + exp(-lambda*T) with T = a + c*b, so T = (a + c*exp(-lambda*T))
    / (1 - lambda*c), about the fluid 4-image batch's 40 ms; busy is the
    share of a cycle spent in the forward, T / (T + exp(-lambda*T)/lambda),
    which equals the work a second, lambda * T(b) / b."""
    a, c = 0.02, 0.005
    base = make_profile()
    profile = msgspec.structs.replace(base, vision=[
        VisionPoint(448, 448, IMAGE_TOKENS, b, a + c * b, a + c * b) for b in (1, 8)])
    load = Workload(images=1, image_tokens=IMAGE_TOKENS, input_len=10, output_len=2, slo_ttft_s=1e6, slo_tpot_s=10)
    rate = 100.0
    forward = a / (1 - rate * c)
    for _ in range(50):   # a contraction: c * lambda * exp(-lambda*T) / (1 - lambda*c) < 0.05
        forward = (a + c * math.exp(-rate * forward)) / (1 - rate * c)
    batch = rate * forward + math.exp(-rate * forward)   # 4.04 images
    encoder = evaluate(profile, load, Layout(1, 1, "dedicated", 2), rate).detail["encoders"][0]
    assert encoder["stable"]
    assert encoder["batch"] == pytest.approx(batch, rel=1e-4)
    assert encoder["busy"] == pytest.approx(forward / (forward + math.exp(-rate * forward) / rate), rel=1e-4)
    assert encoder["busy"] == pytest.approx(rate * (a + c * encoder["batch"]) / encoder["batch"], rel=1e-4)
    assert encoder["busy"] < 0.999   # the fluid limit would say 1
