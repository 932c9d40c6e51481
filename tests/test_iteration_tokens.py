"""Tokens per engine step (pipeline/engine/step_profile.py), exported as
vLLM's vllm:iteration_tokens_total histogram (pipeline/proxy/vllm_metrics.py),
and the per-request choice counts behind vllm:request_params_n."""

from __future__ import annotations

from pipeline.engine.step_profile import ITERATION_TOKEN_BOUNDS, StepProfile
from pipeline.proxy.flights import Choices
from pipeline.proxy.vllm_metrics import _iteration_buckets


def test_each_step_lands_in_the_bucket_of_the_least_bound_it_does_not_exceed():
    profile = StepProfile()
    for tokens in (1, 8, 9, 16, 2048, 2049, 16384, 16385, 50000):
        profile.record("mixed" if tokens > 1 else "decode", {"forward": 0.001}, tokens, 1)
    profile.record("idle", {"schedule": 0.001}, 0, 0)   # ran no tokens: no step of the histogram
    counters = {**profile.counters(), **profile.iteration_counters()}   # as the engine reports them
    by_bucket = {k.split(".", 1)[1]: v for k, v in counters.items() if k.startswith("iteration_tokens.")}
    assert by_bucket == {**{str(b): 0 for b in ITERATION_TOKEN_BOUNDS},
                         "1": 1, "8": 1, "16": 2, "2048": 1, "4096": 1, "16384": 1, "inf": 2}
    buckets, total = _iteration_buckets(counters)
    assert len(buckets) == len(ITERATION_TOKEN_BOUNDS) + 1
    assert buckets[0] == ("1.0", 1) and buckets[3] == ("32.0", 4) and buckets[-1] == ("+Inf", 9)
    assert [count for _, count in buckets] == sorted(count for _, count in buckets)   # cumulative
    assert total == 1 + 8 + 9 + 16 + 2048 + 2049 + 16384 + 16385 + 50000


def test_the_choices_of_a_request_end_once_with_the_longest():
    choices = Choices(3)
    assert choices.ended(4) is None and choices.ended(9) is None
    assert choices.ended(2) == 9
