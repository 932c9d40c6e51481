"""The engine's configuration: the scheduler's budgets and which fast
paths run (engine.py builds from it)."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.engine.decode_graphs import MATMULS
from pipeline.sampling_params import MAX_TOP_LOGPROBS


@dataclass(frozen=True)
class EngineConfig:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    block_size: int = 16
    kv_cache_bytes: int = 64 << 20
    encoder_cache_tokens: int = 16384
    aggregated: bool = False
    local_encode_tokens: int = 8192
    # An embedding may arrive before its request (encoders can beat the
    # proxy's request path); one that no request needs is dropped after this.
    orphan_embedding_ttl: float = 30.0
    # Pure-decode steps through static buffers and one batched attention per
    # layer, captured as CUDA graphs on a GPU. None: on for CUDA, off for CPU.
    fast_decode: bool | None = None
    # Decode graphs for contexts up to this many tokens are captured when the
    # engine starts, longer ones on first use.
    capture_decode_len: int = 4096
    # Mixed steps (prefill chunks beside decodes) through the fused Triton
    # forward, one CUDA graph per token bucket captured at start-up. None: on
    # wherever fast decode runs the Triton kernels (CUDA); True elsewhere
    # needs TRITON_INTERPRET=1 (tests on the CPU). On the 2xH200 box under
    # load, mixed steps took 25-27 ms this way against 270-340 ms eager
    # (docs/benchmarks.md, step profile).
    fast_mixed: bool | None = None
    # What fast decode steps' projections run on: "cublas" (F.linear), or
    # "triton": the small-M Triton matmul for the smallest batch buckets
    # (turns on the fused decode path; mixed steps keep cuBLAS). None:
    # "triton" wherever the fused decode kernels run. On the 2xH200 box it
    # took batch-1 decode from 2.93 to 2.81 ms (docs/benchmarks.md, run G).
    decode_matmul: str | None = None
    # Fast decode steps launched before the last one's tokens are read, so
    # the host's work of a step overlaps the device's (engine/ahead.py).
    # None: on CUDA. At batch 32 on the H200 it took a greedy decode step
    # from 4.31 to 3.29 ms, with the same tokens (docs/benchmarks.md).
    decode_ahead: bool | None = None
    # Small decode batches' fused kernels launched with programmatic
    # dependent launch, each starting while the last one drains
    # (kernels/dependent_launch.py). None: wherever fast decode runs them on
    # a GPU that has it (sm_90+). On the H200 it took the 3B batch-1 decode
    # step from 2.62 to 2.31 ms.
    dependent_launch: bool | None = None
    # Prefill chunks held while decoding requests' mean time between tokens
    # would pass this many ms, at most prefill_pacing_max_hold_ms in a row
    # (engine/pacing.py). None: off.
    prefill_pacing_ms: float | None = None
    prefill_pacing_max_hold_ms: float = 500.0
    # Fast decode and mixed steps replayed as CUDA graphs. False (vLLM's
    # --enforce-eager): the same kernels launched one by one, with no
    # capture at start-up and no graph memory; slower steps.
    cuda_graphs: bool = True
    # Automatic prefix caching (vLLM's --enable-prefix-caching): full KV
    # blocks of computed prompts kept, by content, for later prompts that
    # start the same way (engine/prefix_cache.py).
    prefix_caching: bool = True
    # vLLM's --scheduling-policy: fcfs, or priority (a request's priority, lower first; queue_order.py).
    scheduling_policy: str = "fcfs"
    # vLLM's --max-logprobs: the most top logprobs a request may ask for (a token's, or a prompt token's).
    max_logprobs: int = MAX_TOP_LOGPROBS

    def __post_init__(self):
        if self.decode_matmul is not None and self.decode_matmul not in MATMULS:
            raise ValueError(f"EngineConfig.decode_matmul={self.decode_matmul!r}: want one of {MATMULS}")
