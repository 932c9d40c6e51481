"""vLLM's --seed on the generators: requests without a seed of their own,
sampled, draw the same tokens from generators started with the same seed,
and others from one started with another; epd-launch passes it on."""

from __future__ import annotations

import httpx

from stack import Stack


def sampled_tokens(tmp_path_factory, tiny_dir, seed: int) -> list[str]:
    stack = Stack(tmp_path_factory.mktemp(f"seed{seed}"), tiny_dir, encoders=0, generators=1, aggregated=True,
                  generator_args=("--seed", str(seed)))
    try:
        stack.wait_healthy()
        reply = httpx.post(stack.base_url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "Once", "max_tokens": 8, "temperature": 1.0, "ignore_eos": True,
            "logprobs": 0}).json()
        return reply["choices"][0]["logprobs"]["tokens"]
    finally:
        stack.close()


def test_the_same_seed_draws_the_same_tokens_and_another_does_not(tmp_path_factory, tiny_dir):
    first, again, other = (sampled_tokens(tmp_path_factory, tiny_dir, seed) for seed in (7, 7, 8))
    assert first == again and len(first) == 8
    assert other != first


def test_epd_launch_passes_the_seed_to_the_generators(tiny_dir):
    from pipeline.launch import cli
    from pipeline.launch.plan import HostFacts, plan_stages

    specs = plan_stages(cli.build_options(cli.parse_args([str(tiny_dir), "--device", "cpu", "--seed", "3"])),
                        HostFacts(gpu_count=0))
    assert all(("--seed=3" in s.args) == (s.role == "generator") for s in specs)
