"""How much device memory the KV cache gets when it is sized from the GPU
(the generator's `--kv-cache-mib auto`).

The rule is vLLM's `--gpu-memory-utilization`: the process may use that
share of the GPU's total memory in all. The KV cache gets the share less
what the process already holds (weights, CUDA context) less a reserve for
what is allocated after the cache (step activations, CUDA graphs), and
never more than is free on the device now less that reserve, since other
processes may share the GPU. Plain numbers in, bytes out: the generator
reads them from torch.cuda once the weights are on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.engine import decode_graphs, mixed_graphs
from pipeline.engine.kv_blocks import blocks_needed

GIB = 1 << 30

# Device memory the process holds outside torch's allocator, which
# torch.cuda.memory_reserved does not count: the CUDA context and loaded
# kernel modules (cuBLAS, Triton). About half a GiB with CUDA 12's lazy
# module loading; what other processes hold cannot be told apart from it.
CUDA_CONTEXT_BYTES = 512 << 20

# The reserve formula counts a step's big tensors, not the many small ones
# (attention partials, sampler temporaries, cuBLAS workspaces, graph
# bookkeeping) nor the allocator's fragmentation; this floor covers those.
MIN_RESERVE_BYTES = 1 * GIB


@dataclass(frozen=True)
class DeviceMemory:
    """One GPU as torch.cuda reports it, in bytes."""

    total: int  # the device's memory
    free: int   # free on the device now: excludes every process's use, ours included
    held: int   # what torch's allocator holds for this process (the loaded weights)


@dataclass(frozen=True)
class LanguageShape:
    """The language model's sizes that set the KV cache's and a step's memory."""

    num_layers: int
    kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    max_context: int  # max_position_embeddings
    dtype_bytes: int

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.kv_heads * self.head_dim * self.dtype_bytes


def forward_peak_bytes(tokens: int, hidden_size: int, intermediate_size: int, dtype_bytes: int) -> int:
    """Activations alive at a transformer layer's widest moment, its MLP:
    per token the residual stream, its normed copy and the attention and MLP
    outputs (4 x hidden) beside gate_up (2 x intermediate) and SiLU(gate) *
    up (intermediate). Earlier layers' activations are freed by then."""
    return tokens * (4 * hidden_size + 3 * intermediate_size) * dtype_bytes


def activation_reserve(text: LanguageShape, max_num_batched_tokens: int, max_num_seqs: int,
                       vision_forward_bytes: int = 0, embedding_bytes: int = 0) -> int:
    """Bytes to leave free beside the KV cache: a mixed step's peak and the
    CUDA graphs captured after the cache is allocated. `vision_forward_bytes`:
    the peak of a vision forward that runs in the same process (aggregated
    mode), from forward_peak_bytes. `embedding_bytes`: image embeddings held
    beside the cache (embedding_bytes() below)."""
    # A full step's activations count twice: in the allocator's cache (eager
    # steps, each graph's warm-up run) and in the mixed graphs' private pool,
    # which keeps its peak. The decode graphs' pool holds a step of at most
    # max_num_seqs tokens. A vision forward counts twice for the same reason
    # (eager forwards and the vision graphs' pool).
    step_tokens = 2 * max_num_batched_tokens + max_num_seqs
    activations = forward_peak_bytes(step_tokens, text.hidden_size, text.intermediate_size, text.dtype_bytes)
    activations += 2 * vision_forward_bytes + embedding_bytes
    # Logits are vocab wide but only for the rows that sample, at most one
    # per sequence: the eager step's, its float32 copy in the sampler, and
    # one set per captured graph, each kept alive as that graph's output.
    # Graphs: one per mixed-step token bucket; decode ones per context-length
    # bucket times batch sizes doubling up to max_num_seqs (whose rows sum
    # to under 2 * max_num_seqs).
    graph_rows = max_num_seqs * (_mixed_buckets(max_num_batched_tokens) + 2 * _decode_length_buckets(text))
    logits = text.vocab_size * (max_num_seqs * (text.dtype_bytes + 4) + graph_rows * text.dtype_bytes)
    return max(MIN_RESERVE_BYTES, activations + logits)


def embedding_bytes(encoder_cache_tokens: int, embedding_width: int, hidden_size: int, side_levels: int,
                    max_num_batched_tokens: int, dtype_bytes: int) -> int:
    """Image embeddings a generator holds beside its KV cache, at their real
    width (a wide encoder output is several hidden sizes a token): the
    encoder cache full to its token budget, and a step's side levels twice
    (the eager step's tensor and the mixed graphs' static buffer)."""
    cache = encoder_cache_tokens * embedding_width
    side = 2 * max_num_batched_tokens * side_levels * hidden_size
    return (cache + side) * dtype_bytes


def auto_kv_cache_bytes(memory: DeviceMemory, utilization: float, reserve: int, kv_bytes_per_token: int,
                        max_num_batched_tokens: int, block_size: int) -> int:
    """The KV cache's bytes: utilization * total, less what the process
    holds (memory.held plus CUDA_CONTEXT_BYTES) and the reserve, at most
    memory.free less the reserve. ValueError, naming the numbers and the
    flags to change, if that is less than one request of
    max_num_batched_tokens tokens needs."""
    if not 0 < utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    held = memory.held + CUDA_CONTEXT_BYTES
    share = int(utilization * memory.total) - held - reserve
    budget = min(share, memory.free - reserve)
    needed = blocks_needed(max_num_batched_tokens, block_size) * block_size * kv_bytes_per_token
    if budget < needed:
        raise ValueError(
            f"--kv-cache-mib auto leaves {_gib(budget)} GiB for the KV cache, less than one "
            f"{max_num_batched_tokens}-token request needs ({_gib(needed)} GiB): {utilization:g} of the GPU's "
            f"{_gib(memory.total)} GiB ({_gib(memory.free)} GiB free), less {_gib(held)} GiB this process holds "
            f"(weights, CUDA context) and {_gib(reserve)} GiB kept for activations and CUDA graphs; raise "
            f"--gpu-memory-utilization, lower --max-num-batched-tokens, free memory on the GPU, "
            f"or give --kv-cache-mib a size")
    return budget


def check_max_model_len(kv_bytes: int, kv_bytes_per_token: int, block_size: int, max_model_len: int,
                        sized_by: str) -> None:
    """ValueError, naming the sizes and the flags to change, if a KV cache of
    `kv_bytes` cannot hold one request of `max_model_len` tokens (vLLM's
    start-up check: a request the API accepts must be able to run).
    `sized_by`: how the cache's size was chosen, for the message."""
    bytes_per_block = kv_bytes_per_token * block_size
    tokens = kv_bytes // bytes_per_block * block_size
    if tokens >= max_model_len:
        return
    needed = blocks_needed(max_model_len, block_size) * bytes_per_block
    raise ValueError(
        f"the KV cache holds {tokens} tokens ({_gib(kv_bytes)} GiB, {sized_by}), fewer than one request of "
        f"--max-model-len {max_model_len} needs ({_gib(needed)} GiB); give the cache more memory "
        f"(--gpu-memory-utilization, --kv-cache-mib) or lower --max-model-len to at most {tokens}")


def _mixed_buckets(max_num_batched_tokens: int) -> int:
    """How many token buckets MixedGraphs captures for this budget."""
    top = mixed_graphs.token_bucket(max_num_batched_tokens, mixed_graphs.MIN_TOKENS)
    count, bucket = 0, mixed_graphs.MIN_TOKENS
    while bucket <= top:
        count += 1
        bucket = mixed_graphs.token_bucket(bucket + 1, mixed_graphs.MIN_TOKENS)
    return count


def _decode_length_buckets(text: LanguageShape) -> int:
    """How many context-length buckets DecodeGraphs has up to the model's context."""
    count, length = 1, decode_graphs.MIN_LEN
    while length < text.max_context:
        length, count = length * 2, count + 1
    return count


def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"
