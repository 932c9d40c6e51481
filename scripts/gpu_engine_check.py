#!/usr/bin/env python3
"""The engine on a GPU (run on the GPU box, not in CI):

1. correctness: the tiny checkpoint in float32 on CUDA, several requests with
   images batched through the engine (reference, fast decode, fast decode
   with gemv projections), equal to offline greedy generation of each alone
   on the same device;
   kernels: each fused Triton kernel of the fast paths against its
   PyTorch reference at 3B sizes, and one decode step and one mixed step
   (chunks beside decodes, captured) of the 3B-shaped model (bf16) through
   the fused path against the reference backend;
2. speed: decode step time at batch 1 and 32 for a Qwen2.5-VL-3B-shaped
   language model with random weights (made on the GPU), with the reference
   attention backend, beside the weight-read floor (weight bytes / measured
   device copy bandwidth), all in this one run; for the fast path also the
   graph replay alone and the top CUDA kernels of one replay (torch.profiler);
   a mixed step (a 2048-token prompt joining the batch), on the fast path
   both captured and through the eager batched path it replaced;
   fast_decode_gemv: the fast path with the small-M Triton matmul for the
   projections of buckets of up to 8 rows (EngineConfig.decode_matmul
   "triton"), and decode_gemv_vs_cublas: its times over fast_decode's.

    timeout 1500 python scripts/gpu_engine_check.py [--json out.json] [--modes ...]

Each mode that fails is recorded with its traceback and the run goes on; the
JSON is rewritten after every mode, so a timeout keeps what finished.
"""

from __future__ import annotations

import argparse
import copy
import json
import signal
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

from pipeline.engine.decode_graphs import DecodeGraphs  # noqa: E402
from pipeline.engine.engine import Engine, EngineConfig  # noqa: E402
from pipeline.engine.paged_attention import PagedKVCache, ReferencePagedAttention, SequenceSlice, StepLayout  # noqa: E402
from pipeline.generate import GenerationLimits, greedy_generate  # noqa: E402
from pipeline.models.loader import load_model  # noqa: E402
from pipeline.models.shapes import random_model  # noqa: E402
from pipeline.models.tiny import default_model_dir  # noqa: E402
from pipeline.processing.image import preprocess_images  # noqa: E402
from pipeline.processing.processor import Processor  # noqa: E402
from pipeline.sampling_params import SamplingParams  # noqa: E402
from gpu_decode_speed import decode_speed, matmul_comparison  # noqa: E402
from gpu_mixed_check import fused_mixed_equality, unified_equality  # noqa: E402


def attention_equality(device: torch.device) -> dict:
    """The fast decode attention against the reference backend, bf16, 3B-like heads."""
    from pipeline.engine.decode_graphs import GatherDecodeAttention

    gen = torch.Generator(device=device).manual_seed(0)
    cache = PagedKVCache(1, 600, 16, 2, 128, torch.bfloat16, device)
    cache.keys.normal_(generator=gen)
    cache.values.normal_(generator=gen)
    lens = [5, 300, 1023, 77]
    tables = [list(range(1 + 70 * i, 1 + 70 * i + (n + 16) // 16)) for i, n in enumerate(lens)]
    q = torch.randn(len(lens), 16, 128, device=device, dtype=torch.bfloat16, generator=gen)
    k = torch.randn(len(lens), 2, 128, device=device, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(len(lens), 2, 128, device=device, dtype=torch.bfloat16, generator=gen)
    layout = StepLayout.build([SequenceSlice(i, 1, n, tuple(t)) for i, (n, t) in enumerate(zip(lens, tables))],
                              16, device)
    ref = ReferencePagedAttention(cache, layout).attend(0, q, k, v)
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device)
    slots = torch.tensor([t[n // 16] * 16 + n % 16 for t, n in zip(tables, lens)], device=device)
    lengths = torch.tensor(lens, device=device) + 1
    fast = GatherDecodeAttention(cache, slots, bt, lengths, 1024).attend(0, q, k, v)
    diff = (fast.float() - ref.float()).abs().max().item()
    out = {"max_abs_diff": diff, "ref_max_abs": ref.float().abs().max().item(), "ok": diff <= 2e-2}
    from pipeline.kernels.paged_backend import TritonDecodeAttention
    triton = TritonDecodeAttention(cache, slots, bt, lengths, 1024, _num_sms(device)).attend(0, q, k, v)
    out["triton"] = _compare(triton, ref)
    out["ok"] = out["ok"] and out["triton"]["ok"]
    return out


def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _compare(got: torch.Tensor, want: torch.Tensor, rel: float = 2e-2) -> dict:
    """bf16 agreement: within `rel` of the reference's largest magnitude (a
    few bf16 ulps: the kernels round once where the references round per op)."""
    diff = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item()
    return {"max_abs_diff": diff, "ref_max_abs": scale, "ok": diff <= rel * max(scale, 1.0)}


def kernel_equality(device: torch.device) -> dict:
    """Each fused kernel against its PyTorch reference, bf16, 3B sizes."""
    from pipeline.kernels import activation, decode_attention, rmsnorm, rotary_kv

    gen = torch.Generator(device=device).manual_seed(1)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.bfloat16)

    x, delta, weight = randn(32, 2048), randn(32, 2048), 1 + 0.1 * randn(2048)
    got, want = rmsnorm.add_rms_norm(x, delta, weight, 1e-6), rmsnorm.add_rms_norm_reference(x, delta, weight, 1e-6)
    out = {"add_rms_norm": _compare(got[1], want[1]), "add_rms_norm_residual": _compare(got[0], want[0])}
    gate_up = randn(32, 2 * 11008)
    out["silu_mul"] = _compare(activation.silu_mul(gate_up), activation.silu_mul_reference(gate_up))
    qkv, angles = randn(32, 20, 128), torch.rand(32, 64, generator=gen, device=device) * 500
    angles = torch.cat([angles, angles], -1)
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    slots = torch.randperm(9600, generator=gen, device=device)[:32]
    caches = [randn(9600, 2, 128) for _ in range(2)]
    mine, theirs = [c.clone() for c in caches], [c.clone() for c in caches]
    q = rotary_kv.rotary_kv_write(qkv, cos, sin, 16, *mine, slots)
    want_q = rotary_kv.rotary_kv_write_reference(qkv, cos, sin, 16, *theirs, slots)
    out["rotary_q"], out["rotary_k_cache"] = _compare(q, want_q), _compare(mine[0], theirs[0])
    out["rotary_v_cache"] = _compare(mine[1], theirs[1])
    lengths = torch.tensor([1, 17, 300, 1023, 77, 1], device=device)  # last: padding row on the null block
    tables = torch.full((6, 64), 599, device=device)
    order = torch.randperm(599, generator=gen, device=device)  # scattered, not contiguous, blocks
    for i, n in enumerate(lengths[:5].tolist()):
        tables[i, :-(-n // 16)] = order[70 * i:70 * i - (-n // 16)]
    q = randn(6, 16, 128)
    want = decode_attention.paged_decode_attention_reference(q, *caches, tables, lengths, 16)
    for name, splits in (("planned", decode_attention.plan_splits(6, 2, 1024, _num_sms(device))),
                         ("one_split", (1, 1024))):
        got = decode_attention.paged_decode_attention(q, *caches, tables, lengths, 16, *splits)
        out[f"paged_attention_{name}"] = dict(_compare(got, want), splits=splits[0])
    out.update(unified_equality(device, _compare))
    out.update(gemv_rotary_equality(device, randn))
    return out


def _same(got: torch.Tensor, want: torch.Tensor) -> dict:
    """A fused kernel that must round as the kernels it replaces: bit for bit."""
    return {"max_abs_diff": (got.float() - want.float()).abs().max().item(), "ok": torch.equal(got, want)}


def gemv_rotary_equality(device: torch.device, randn) -> dict:
    """gemv_rotary_kv against gemv then rotary_kv_write at the 3B q/k/v
    shape, 1 and 2 rows, bf16: q and both caches bit for bit."""
    from pipeline.kernels import gemv, gemv_rotary, rotary_kv

    out = {}
    weight, bias = randn(2560, 2048) * 0.02, randn(2560)
    for rows in (1, 2):
        x = randn(rows, 2048)
        angles = torch.rand(rows, 64, device=device) * 500
        angles = torch.cat([angles, angles], -1)
        cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
        slots = torch.randperm(9600, device=device)[:rows]
        caches = [randn(9600, 2, 128) for _ in range(2)]
        mine, theirs = [c.clone() for c in caches], [c.clone() for c in caches]
        q = gemv_rotary.gemv_rotary_kv(x, weight, bias, cos, sin, 16, *mine, slots)
        qkv = gemv.gemv(x, weight, bias).view(rows, 20, 128)
        want_q = rotary_kv.rotary_kv_write(qkv, cos, sin, 16, *theirs, slots)
        out[f"gemv_rotary_q_{rows}"] = _same(q, want_q)
        out[f"gemv_rotary_caches_{rows}"] = _same(torch.stack(mine), torch.stack(theirs))
    return out


def _prefill_then_step(model: torch.nn.Module, device: torch.device, lens, bs: int = 16, num_blocks: int = 160):
    """Each sequence prefilled alone through the reference backend into a
    paged cache with scattered blocks; then one decode step of them all.
    Returns (reference logits of that step, cache, tables, step ids, positions)."""
    lang = model.spec.language
    cache = PagedKVCache(lang.num_layers, num_blocks + 1, bs, lang.kv_heads, lang.head_dim,
                         next(model.parameters()).dtype, device)
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
    tables = []
    for n in lens:  # room for the decode token at index n
        tables.append(order[:n // bs + 1])
        order = order[n // bs + 1:]
    rng = np.random.default_rng(0)
    with torch.inference_mode():
        for n, table in zip(lens, tables):
            layout = StepLayout.build([SequenceSlice(0, n, 0, tuple(table))], bs, device)
            ids = torch.tensor(rng.integers(0, lang.vocab_size, n), device=device)
            model(model.embed(ids), model.decode_positions(0, n, 0).to(device), ReferencePagedAttention(cache, layout))
        step = [int(x) for x in rng.integers(0, lang.vocab_size, len(lens))]
        positions = torch.cat([model.decode_positions(n, 1, 0) for n in lens], dim=1)
        layout = StepLayout.build([SequenceSlice(i, 1, n, tuple(t)) for i, (n, t) in enumerate(zip(lens, tables))],
                                  bs, device)
        hidden = model(model.embed(torch.tensor(step, device=device)), positions.to(device),
                       ReferencePagedAttention(cache, layout))
        return model.logits(hidden).float(), cache, tables, step, positions


def fused_decode_equality(model: torch.nn.Module, exact: torch.nn.Module, device: torch.device,
                          lens=(1, 17, 300, 700)) -> dict:
    """One decode step of a bf16 model (fuse()d) through the reference
    backend, the gather fast path and the fused Triton path, each against the
    same step of `exact` (the float32 copy of its weights). bf16 paths round
    differently; the fused one must be about as close to float32 as the others."""
    truth = _prefill_then_step(exact, device, lens)[0]
    want, cache, tables, step, positions = _prefill_then_step(model, device, lens)
    scale = truth.abs().max().item()

    def against_truth(logits):
        return {"max_abs_diff": (logits - truth).abs().max().item(),
                "top1_agree": (logits.argmax(-1) == truth.argmax(-1)).float().mean().item()}

    out = {"ref_max_abs": scale, "reference": against_truth(want)}
    paths = (("fused", True, "cublas"), ("fused_gemv", True, "triton"), ("gather", False, "cublas"))
    with torch.inference_mode():
        for name, fused, matmul in paths:
            graphs = DecodeGraphs(model, cache, len(cache.keys[0]) - 1, 8, 1024, device, use_graphs=True,
                                  fused=fused, matmul=matmul)
            got = graphs.run(step, positions, tables, list(lens)).float()
            out[name] = dict(against_truth(got), max_abs_diff_vs_bf16_reference=(got - want).abs().max().item())
    baseline = max(out["reference"]["max_abs_diff"], out["gather"]["max_abs_diff"])
    out["ok"] = all(out[name]["max_abs_diff"] <= 1.5 * baseline + 0.01 * scale for name in ("fused", "fused_gemv"))
    return out


def correctness(device: torch.device, fast_decode: bool, matmul: str = "cublas") -> dict:
    model_dir = default_model_dir()
    loaded = load_model(model_dir, dtype="float32", device=str(device))
    processor = Processor.from_checkpoint(model_dir, loaded.config.image_token_id)
    rng = np.random.default_rng(0)
    requests = {}
    for i in range(6):
        images = [Image.fromarray(rng.integers(0, 256, (64 + 32 * j, 96, 3), dtype=np.uint8)) for j in range(i % 3)]
        msgs = [{"role": "user", "content": [{"type": "image"}] * len(images) + [{"type": "text", "text": f"case {i} " * (i + 1)}]}]
        prompt = processor.chat_prompt(msgs, [(im.height, im.width) for im in images])
        pixels = [preprocess_images([im], processor.image_config) for im in images]
        requests[f"r{i}"] = (prompt, [(p, tuple(g[0].tolist())) for p, g in pixels])
    expected = {}
    for rid, (prompt, inputs) in requests.items():
        pix = torch.cat([p for p, _ in inputs]) if inputs else None
        expected[rid] = greedy_generate(loaded.model, prompt, pix, GenerationLimits(16, frozenset(), True))
    engine = Engine(loaded.model, processor.tokenizer,
                    EngineConfig(max_num_batched_tokens=128, fast_decode=fast_decode, fast_mixed=None,
                                 decode_matmul=matmul), device)
    got = {rid: [] for rid in requests}
    for rid, (prompt, inputs) in requests.items():
        keys = [f"{rid}-{j}" for j in range(len(inputs))]
        engine.add_request(rid, prompt, keys, SamplingParams(max_tokens=16, ignore_eos=True))
        for key, (p, g) in zip(keys, inputs):
            engine.add_embedding(key, loaded.model.encode_images(p.to(device), [g])[0])
    while engine.has_work():
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    mismatches = [rid for rid in requests if got[rid] != expected[rid]]
    return {"requests": len(requests), "mismatches": mismatches}


def _failed(report: dict) -> list[str]:
    """Names of the checks that failed or raised."""
    bad = [k for k, v in report.items() if isinstance(v, dict) and "error" in v]
    bad += [k for k in ("attention_equality", "fused_decode_equality", "fused_mixed_equality")
            if not report.get(k, {}).get("ok", True)]
    bad += [f"kernel_equality.{k}" for k, v in report.get("kernel_equality", {}).items()
            if isinstance(v, dict) and not v["ok"]]
    bad += [f"correctness.{k}" for k, v in report.get("correctness", {}).items()
            if isinstance(v, dict) and v.get("mismatches")]
    return bad


def _sections(device: torch.device, modes: list[str], batches: list[int], report: dict, profile: bool):
    """(report key, work) in run order; a speed section fills its dict as it goes."""
    if "correctness" in modes:
        yield "attention_equality", lambda: attention_equality(device)
        yield "correctness", lambda: {mode: correctness(device, fast, matmul) for mode, fast, matmul in
                                      (("reference", False, "cublas"), ("fast_decode", True, "cublas"),
                                       ("fast_decode_gemv", True, "triton"))}
    if "kernels" in modes:
        yield "kernel_equality", lambda: kernel_equality(device)

        def fused_model(check):
            model = random_model("qwen2.5-vl-3b", torch.bfloat16, device).model
            exact = copy.deepcopy(model).float()
            exact.reset_buffers()  # rotary tables in float32, as a float32 model makes them
            model.fuse()
            return check(model, exact, device)
        yield "fused_decode_equality", lambda: fused_model(fused_decode_equality)
        yield "fused_mixed_equality", lambda: fused_model(fused_mixed_equality)
    for mode, fast, matmul in (("reference", False, "cublas"), ("fast_decode", True, "cublas"),
                               ("fast_decode_gemv", True, "triton")):
        if mode in modes:
            out = report.setdefault(f"decode_{mode}", {})
            yield f"decode_{mode}", lambda fast=fast, out=out, matmul=matmul: decode_speed(
                device, batches, fast, out, profile=profile, matmul=matmul)
    if "fast_decode" in modes and "fast_decode_gemv" in modes:
        yield "decode_gemv_vs_cublas", lambda: matmul_comparison(
            report["decode_fast_decode"], report["decode_fast_decode_gemv"], batches)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--json", type=Path)
    p.add_argument("--batches", default="1,32")
    p.add_argument("--modes", default="correctness,kernels,reference,fast_decode,fast_decode_gemv",
                   help="comma list of: correctness, kernels, reference, fast_decode, fast_decode_gemv")
    p.add_argument("--no-profile", action="store_true", help="skip the per-kernel profile of a graph replay")
    args = p.parse_args()
    device = torch.device("cuda:0")
    report = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    try:
        import triton
        report["triton"] = triton.__version__
    except ImportError:
        report["triton"] = None
    # `timeout` sends SIGTERM: leave through the finally below, which saves.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    batches = [int(b) for b in args.batches.split(",")]
    try:
        for key, work in _sections(device, args.modes.split(","), batches, report, not args.no_profile):
            try:
                report[key] = work()
            except Exception:  # recorded and reported in the exit status; the next mode still runs
                report.setdefault(key, {})
                report[key]["error"] = traceback.format_exc()
            print(f"{key}:", json.dumps(report[key]), flush=True)
            if args.json:
                args.json.write_text(json.dumps(report, indent=2))
    finally:
        report["failed"] = _failed(report)
        if args.json:
            args.json.write_text(json.dumps(report, indent=2))
        print("failed:", report["failed"], flush=True)
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
