"""Small-M matmul (GEMV) for decode: y = x @ weight.T (+ bias), F.linear's
contract for x [..., K] with few rows and weight [N, K] in nn.Linear layout.

With 1..16 rows the product is pure weight streaming: every weight element is
read once and used M times, so the kernel is shaped for bandwidth, not
FLOPs. Program (n_block, split) streams [BLOCK_N, BLOCK_K] tiles of its rows
of W, coalesced along K (W's contiguous axis), and multiplies them with the
matching [M, BLOCK_K] slice of x, which is tiny and stays in L2. Accumulation
is float32; the output is rounded once to x's dtype, after the bias.

How the tile is multiplied is a config choice (GemvConfig.mode):
  "defer"  - FMA into a [M, BLOCK_N, BLOCK_K] float32 accumulator, summed
             over K once after the loop: no cross-thread work in the loop,
             but M times the tile in registers (meant for M of 1 or 2).
  "reduce" - FMA, then summed over K every iteration (warp shuffles per
             tile; registers stay at [M, BLOCK_N]).
  "dot"    - tl.dot on tensor cores, x padded to 16 rows; scales to larger M.
gemv_silu_mul fuses the gated MLP's activation into the epilogue: weight
[2H, K] holds gate rows then up rows (GatedMLP.fuse); a program streams the
gate and up rows of the same outputs interleaved in one tile, so the tile's
sums pair up and silu(gate) * up is written directly ([M, H]), one kernel
and no [M, 2H] intermediate. It rounds as gemv then silu_mul would.
gemv_rotary.py runs the same main loop (stream_rows) with the rotary and
K/V cache write as its epilogue. At one row a program whose weight slice is
small enough reads all of it before its grid wait instead of in the loop
(GemvConfig.preload): under PDL it streams in while the kernel before
finishes.

Split-K (split_k > 1) cuts K over programs for shapes with too few row
blocks to fill the GPU; each split writes float32 partials and a second
kernel sums them, adds the bias and casts (two launches, deterministic, no
zero-filled workspace). Every launch has a fixed grid and allocates only
with torch.empty, so calls are CUDA-graph capturable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pipeline.kernels import interpreting, next_power_of_2
from pipeline.kernels.activation import silu_mul
from pipeline.kernels.dependent_launch import launch_options, release_dependents, wait_only, wait_then_release

MODES = ("defer", "reduce", "dot")
MODE_IDS = {name: i for i, name in enumerate(MODES)}
_DOT_MIN = 16  # tl.dot wants every extent >= 16
_SMS = 132  # H200; only default_config's guesses depend on it


def _power_of_2_in(name: str, value: int, low: int, high: int) -> None:
    if value < low or value > high or value & (value - 1):
        raise ValueError(f"GemvConfig.{name}={value}: want a power of two in [{low}, {high}]")


@dataclass(frozen=True)
class GemvConfig:
    """One launch shape: W rows per program (block_n), K per tile (block_k),
    programs along K (split_k), how a tile is multiplied (mode, see the
    module docstring), and tiles in flight per program (num_stages; 1 is
    plain loads, more is cp.async into shared memory). `preload`: each
    program reads its whole weight slice (block_n x K, at most PRELOAD_MAX
    elements) in one load before its grid wait, then multiplies it by FMA
    with one K-sum; block_k, mode and num_stages then do not apply."""
    block_n: int = 16
    block_k: int = 256
    split_k: int = 1
    mode: str = "reduce"
    num_warps: int = 4
    num_stages: int = 4
    preload: bool = False

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"GemvConfig.mode={self.mode!r}: want one of {MODES}")
        low = _DOT_MIN if self.mode == "dot" else 1
        _power_of_2_in("block_n", self.block_n, low, 512)
        _power_of_2_in("block_k", self.block_k, low, 4096)
        _power_of_2_in("num_warps", self.num_warps, 1, 16)
        if not 1 <= self.split_k <= 64:
            raise ValueError(f"GemvConfig.split_k={self.split_k}: want 1..64")
        if not 1 <= self.num_stages <= 8:
            raise ValueError(f"GemvConfig.num_stages={self.num_stages}: want 1..8")
        if self.preload and self.split_k > 1:
            raise ValueError("GemvConfig.preload reads a program's whole K: it excludes split_k > 1")

    def check_preload(self, K: int) -> None:
        if self.preload and self.block_n * next_power_of_2(K) > PRELOAD_MAX:
            raise ValueError(f"GemvConfig.preload: {self.block_n} rows of {K} exceed PRELOAD_MAX={PRELOAD_MAX}")


# Weight elements a program may read before its wait (preload): 64 a thread
# at 4 warps. On an H200, a q/k/v- or o_proj-shaped projection of one row
# after add + RMSNorm, chained with PDL, took 0.7 us less a pair read this
# way. Launched without PDL there is no wait to overlap, and the one-shot
# load was 3-7% slower a pair than the pipelined loop (session 24); the
# default keeps one arithmetic for both launches, so PDL stays checkable
# against plain launches token for token.
PRELOAD_MAX = 8192

# Output widths from here up (gate_up, lm_head of a 3B model) give even
# 8-row blocks several programs per SM; narrower ones (qkv, o_proj, down)
# need 4-row blocks to fill the GPU.
_WIDE_N = 32 * _SMS


def default_config(M: int, N: int, K: int) -> GemvConfig:
    """The fastest config scripts/gpu_gemv_bench.py measured on an H200 at
    the 3B decode shapes (docs/benchmarks.md, issue 4): FMA with a deferred
    K-sum into 4-row blocks for narrow outputs at 1-2 rows; tensor-core dots
    otherwise (64-row blocks for wide outputs, 16 for narrow). One row whose
    weight slice fits preloads it (see GemvConfig and PRELOAD_MAX)."""
    wide = N >= _WIDE_N
    if M <= 2 and not wide:
        block_n, block_k, mode, stages = 4, 512, "defer", 4
    elif wide:
        block_n, block_k, mode, stages = 64, 128, "dot", 4
    else:
        block_n, block_k, mode, stages = 16, 256, "dot", 4
    # Split-K costs a second launch: only where the row blocks cannot even
    # give every SM one program and K is long enough to share out.
    split_k = 1
    while K >= 4096 and triton.cdiv(N, block_n) * split_k < _SMS and split_k < 8:
        split_k *= 2
    preload = M == 1 and split_k == 1 and block_n * next_power_of_2(K) <= PRELOAD_MAX
    return GemvConfig(block_n=block_n, block_k=block_k, split_k=split_k, mode=mode, num_stages=stages,
                      preload=preload)


def beats_cublas(M: int, N: int) -> bool:
    """Whether gemv's default config was measured faster than cuBLAS for
    M rows and N outputs (H200, 3B decode shapes, gpu_gemv_bench.py):
    narrow outputs at 1-2 rows (1.13-1.30x), wide ones up to 8 rows
    (1.02-1.07x). Past that cuBLAS's tiles reuse each weight read enough
    to win; at 3-8 rows of a narrow output it was 2-8% ahead."""
    return 0 < M <= (8 if N >= _WIDE_N else 2)


@triton.jit
def stream_rows(x_ptr, w_ptr, rm, rn, m_mask, n_mask, k_start, k_end, x_stride, w_stride,
                MODE: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
                NUM_STAGES: tl.constexpr):
    """The main loop: x's rows rm times W's rows rn over K in [k_start,
    k_end), summed in float32; returns [BLOCK_M, BLOCK_N]."""
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + rm[:, None] * x_stride + (k_start + rk)[None, :]
    # int64 row offsets: a weight past 2**31 elements must not wrap.
    w_ptrs = w_ptr + rn.to(tl.int64)[:, None] * w_stride + (k_start + rk)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    if MODE == 0:
        acc3 = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), tl.float32)
    # Explicit stages: without them Triton pipelines (cp.async into shared
    # memory, NUM_STAGES tiles in flight) only loads that feed a tl.dot.
    for k in tl.range(k_start, k_end, BLOCK_K, num_stages=NUM_STAGES):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0, eviction_policy="evict_first")
        else:
            k_mask = (k + rk < k_end)[None, :]
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask, other=0.0)
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask, other=0.0, eviction_policy="evict_first")
        if MODE == 0:
            acc3 += x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :]
        elif MODE == 1:
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
        elif UPCAST_DOT:
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if MODE == 0:
        acc = tl.sum(acc3, axis=2)
    return acc


@triton.jit
def preload_rows(w_ptr, rn, n_mask, w_stride, K, BLOCK_KP: tl.constexpr):
    """W's rows rn, all of K (BLOCK_KP: K's next power of two), in one load."""
    rk = tl.arange(0, BLOCK_KP)
    return tl.load(w_ptr + rn.to(tl.int64)[:, None] * w_stride + rk[None, :],
                   mask=n_mask[:, None] & (rk < K)[None, :], other=0.0, eviction_policy="evict_first")


@triton.jit
def multiply_preloaded(x_ptr, rm, m_mask, x_stride, w, K, BLOCK_KP: tl.constexpr):
    """x's rows rm times preload_rows' w, summed over K in float32."""
    rk = tl.arange(0, BLOCK_KP)
    x = tl.load(x_ptr + rm[:, None] * x_stride + rk[None, :], mask=m_mask[:, None] & (rk < K)[None, :], other=0.0)
    return tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, bias_ptr, out_ptr, part_ptr, M, N, K, k_per_split, x_stride, w_stride,
                 HAS_BIAS: tl.constexpr, MODE: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
                 UPCAST_DOT: tl.constexpr, NUM_STAGES: tl.constexpr, USE_GDC: tl.constexpr,
                 GATED: tl.constexpr = False, PRELOAD: tl.constexpr = False, BLOCK_KP: tl.constexpr = 1):
    pid_n, split = tl.program_id(0), tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    if GATED:
        # Tile row j is output column pid_n * BLOCK_N / 2 + j // 2: its gate
        # row for even j, its up row (N rows further) for odd j. N here is
        # the output width, half the weight's rows.
        tl.static_assert(SPLIT_K == 1)
        j = tl.arange(0, BLOCK_N)
        out_col = pid_n * (BLOCK_N // 2) + j // 2
        rn = out_col + (j % 2) * N
        n_mask = out_col < N
    else:
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = rn < N
    m_mask = rm < M
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    if PRELOAD:
        # The weight never depends on the kernel before this one: read
        # before the wait, it streams in while that kernel finishes.
        w = preload_rows(w_ptr, rn, n_mask, w_stride, K, BLOCK_KP)
    # Gated, the next kernel is the down projection: released at the top,
    # its waiting programs would take SM slots from this grid's later
    # programs, so it is released after the loop instead.
    wait_only(USE_GDC)
    if not GATED:
        release_dependents(USE_GDC)
    if PRELOAD:
        acc = multiply_preloaded(x_ptr, rm, m_mask, x_stride, w, K, BLOCK_KP)
    else:
        acc = stream_rows(x_ptr, w_ptr, rm, rn, m_mask, n_mask, k_start, k_end, x_stride, w_stride,
                          MODE, EVEN_K, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, UPCAST_DOT, NUM_STAGES)
    if GATED:
        release_dependents(USE_GDC)
    out_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        if GATED:
            _store_silu_mul(acc, out_ptr, rm, m_mask, pid_n, N, BLOCK_M, BLOCK_N)
        else:
            tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        tl.store(part_ptr + (split * M + rm)[:, None] * N + rn[None, :], acc, mask=out_mask)


@triton.jit
def _store_silu_mul(acc, out_ptr, rm, m_mask, pid_n, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The gated epilogue: acc's interleaved (gate, up) columns -> silu(gate)
    * up, rounded as silu_mul rounds the projection's stored output."""
    dtype = out_ptr.dtype.element_ty
    pairs = tl.reshape(acc.to(dtype).to(tl.float32), (BLOCK_M, BLOCK_N // 2, 2))
    gate, up = tl.split(pairs)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    cols = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    mask = m_mask[:, None] & (cols < N)[None, :]
    tl.store(out_ptr + rm[:, None] * N + cols[None, :], (act * up).to(dtype), mask=mask)


@triton.jit
def _split_sum_kernel(part_ptr, bias_ptr, out_ptr, M, N,
                      HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr,
                      USE_GDC: tl.constexpr):
    wait_then_release(USE_GDC)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.zeros((BLOCK,), tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + (s * M + row) * N + cols, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def check_operands(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if weight.dim() != 2 or weight.stride(1) != 1:
        raise ValueError(f"gemv wants weight [N, K] with K contiguous, got {tuple(weight.shape)} "
                         f"strides {weight.stride()}")
    if x.shape[-1] != weight.shape[1] or x.dtype != weight.dtype:
        raise ValueError(f"gemv: x {tuple(x.shape)} {x.dtype} does not match weight "
                         f"{tuple(weight.shape)} {weight.dtype}")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.stride(0) != 1 or bias.dtype != x.dtype):
        raise ValueError(f"gemv: bias {tuple(bias.shape)} {bias.dtype} should be contiguous "
                         f"[{weight.shape[0]}] {x.dtype}")


def _rows(x: torch.Tensor, K: int) -> torch.Tensor:
    x2 = x.reshape(-1, K)
    return x2 if x2.stride(1) == 1 else x2.contiguous()


def tile_rows(M: int, cfg: GemvConfig) -> int:
    """BLOCK_M for M rows: the next power of two, at least 16 for tl.dot
    (a preloading config multiplies by FMA whatever its mode)."""
    block_m = next_power_of_2(M)
    return max(_DOT_MIN, block_m) if cfg.mode == "dot" and not cfg.preload else block_m


def _launch(x2: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cfg: GemvConfig,
            out: torch.Tensor, gated: bool) -> None:
    """One gemv into out [M, N] (gated: N = weight rows / 2, see gemv_silu_mul)."""
    M, (rows, K) = x2.shape[0], weight.shape
    cfg.check_preload(K)
    N = rows // 2 if gated else rows
    k_per_split = triton.cdiv(triton.cdiv(K, cfg.block_k), cfg.split_k) * cfg.block_k
    part = out
    if cfg.split_k > 1:
        part = torch.empty((cfg.split_k, M, N), dtype=torch.float32, device=x2.device)
    block_m = tile_rows(M, cfg)
    has_bias = bias is not None
    bias_arg = bias if has_bias else weight  # never read without HAS_BIAS
    pdl = launch_options()
    _gemv_kernel[(triton.cdiv(rows, cfg.block_n), cfg.split_k)](
        x2, weight, bias_arg, out, part, M, N, K, k_per_split, x2.stride(0), weight.stride(0),
        HAS_BIAS=has_bias, MODE=MODE_IDS[cfg.mode], SPLIT_K=cfg.split_k, EVEN_K=K == k_per_split * cfg.split_k,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        PRECISION="ieee" if x2.dtype == torch.float32 else "tf32",
        # Triton's interpreter multiplies bf16 (kept as uint16) bit patterns in
        # tl.dot; products of bf16 values are exact in float32, so upcasting
        # there computes what the GPU's bf16 dot does.
        UPCAST_DOT=interpreting() and x2.dtype == torch.bfloat16,
        NUM_STAGES=cfg.num_stages, GATED=gated, PRELOAD=cfg.preload,
        BLOCK_KP=next_power_of_2(K) if cfg.preload else 1,   # one compiled variant per K only where it is used
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **pdl)
    if cfg.split_k > 1:
        block = 1024
        _split_sum_kernel[(M, triton.cdiv(N, block))](part, bias_arg, out, M, N, HAS_BIAS=has_bias,
                                                      SPLIT_K=cfg.split_k, BLOCK=block, num_warps=4, **pdl)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [..., K] with few rows (flattened to M);
    returns [..., N] in x's dtype. `config` defaults to default_config."""
    check_operands(x, weight, bias)
    N, K = weight.shape
    x2 = _rows(x, K)
    cfg = config or default_config(x2.shape[0], N, K)
    out = torch.empty((x2.shape[0], N), dtype=x.dtype, device=x.device)
    _launch(x2, weight, bias, cfg, out, gated=False)
    return out.reshape(*x.shape[:-1], N)


def gemv_silu_mul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: GemvConfig | None = None) -> torch.Tensor:
    """silu(gate) * up of the fused projection F.linear(x, weight, bias),
    weight [2H, K] gate rows then up rows: returns [..., H], what
    silu_mul(gemv(x, weight, bias)) returns, in one kernel. A split-K config
    (whose partials meet in a second kernel) runs as those two calls."""
    check_operands(x, weight, bias)
    rows, K = weight.shape
    if rows % 2:
        raise ValueError(f"gemv_silu_mul wants weight [2 * hidden, K], got {tuple(weight.shape)}")
    x2 = _rows(x, K)
    cfg = config or default_config(x2.shape[0], rows, K)
    if cfg.split_k > 1 or cfg.block_n < 2:
        return silu_mul(gemv(x2, weight, bias, cfg)).reshape(*x.shape[:-1], rows // 2)
    out = torch.empty((x2.shape[0], rows // 2), dtype=x.dtype, device=x.device)
    _launch(x2, weight, bias, cfg, out, gated=True)
    return out.reshape(*x.shape[:-1], rows // 2)


def gemv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What gemv computes, for the tests."""
    return F.linear(x, weight, bias)
