#!/usr/bin/env python3
"""Qwen3-VL through the engine on a GPU (run on the GPU box, not in CI).

Tiny random checkpoints written by transformers (both DeepStack shapes of
tests/qwen3_vl_helpers.py), in float32 on CUDA: requests with images of
several sizes, chunked, through the engine with the reference paths and
with the fast paths (fused Triton decode and mixed steps, captured as CUDA
graphs, DeepStack levels through the static side buffer); each equal to
offline greedy generation of the request alone on the same device, which is
compared with transformers' own generate on that device.

    python3 scripts/gpu_qwen3_check.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

import torch  # noqa: E402

import qwen3_vl_helpers as helpers  # noqa: E402
from pipeline.engine.engine import Engine, EngineConfig  # noqa: E402
from pipeline.models.loader import load_model  # noqa: E402
from pipeline.models.tiny import default_model_dir  # noqa: E402
from pipeline.processing.tokenizer import Tokenizer  # noqa: E402
from test_engine import run_engine  # noqa: E402
from test_qwen3_vl_engine import make_request, offline  # noqa: E402


def reference_tokens(folder: Path, prompt, inputs, device: torch.device, max_tokens: int) -> list[int]:
    from transformers import Qwen3VLForConditionalGeneration

    reference = Qwen3VLForConditionalGeneration.from_pretrained(folder, torch_dtype=torch.float32).to(device).eval()
    ids = torch.tensor([prompt.token_ids], device=device)
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids),
                  mm_token_type_ids=(ids == helpers.IMAGE_TOKEN).int())
    if inputs:
        kwargs.update(pixel_values=torch.cat([p for p, _ in inputs]).to(device),
                      image_grid_thw=torch.tensor([g for _, g in inputs], device=device))
    with torch.no_grad():
        return reference.generate(**kwargs, max_new_tokens=max_tokens, do_sample=False)[0, ids.shape[1]:].tolist()


def check_shape(name: str, device: torch.device, report: dict) -> None:
    row = report.setdefault(name, {})
    with tempfile.TemporaryDirectory() as tmp:
        folder = helpers.write_checkpoint(Path(tmp), helpers.SHAPES[name])
        model = load_model(folder, device=str(device)).model
        tokenizer = Tokenizer.from_checkpoint(default_model_dir())
        requests = {}
        for i in range(6):
            prompt, keys, inputs = make_request(30 + i, i % 3)
            requests[f"r{i}"] = prompt, keys, [(pixels.to(device), grid) for pixels, grid in inputs]
        expected = {rid: offline(model, p, inp, 10) for rid, (p, _, inp) in requests.items()}
        prompt, _, inputs = requests["r2"]
        row["offline_equals_transformers"] = expected["r2"] == reference_tokens(folder, prompt, inputs, device, 10)
        for mode, fast in (("reference", False), ("fast", True)):
            config = EngineConfig(max_num_batched_tokens=32, max_num_seqs=6, block_size=16, kv_cache_bytes=8 << 20,
                                  fast_decode=fast, fast_mixed=fast)
            engine = Engine(model, tokenizer, config, device)
            outputs, _ = run_engine(engine, model, requests, {0: ["r0", "r1", "r2"], 3: ["r3", "r4", "r5"]},
                                    {}, max_tokens=10)
            row[f"{mode}_equals_offline"] = outputs == expected
            row[f"{mode}_mismatches"] = sorted(r for r in expected if outputs.get(r) != expected[r])
    print(name, json.dumps(row), flush=True)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--json", type=Path)
    p.add_argument("--device", default="cuda:0")
    args = p.parse_args()
    device = torch.device(args.device)
    report: dict = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    for name in sorted(helpers.SHAPES):
        try:
            check_shape(name, device, report)
        except Exception:  # recorded; the other shape still runs
            report.setdefault(name, {})["error"] = traceback.format_exc()
            print(report[name]["error"], flush=True)
    report["failed"] = [n for n in helpers.SHAPES if "error" in report[n]
                        or not all(v for k, v in report[n].items() if k.endswith("equals_offline")
                                   or k == "offline_equals_transformers")]
    print("failed:", report["failed"], flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
