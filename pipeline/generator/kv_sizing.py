"""The generator's KV cache from its flags: --kv-cache-mib N|auto (auto:
sized from the GPU by --gpu-memory-utilization, pipeline/engine/kv_budget.py)
and the start-up check that it holds one request of --max-model-len."""

from __future__ import annotations

import argparse

import torch

from pipeline.arg_parser import at_least_one
from pipeline.engine.kv_budget import (
    GIB, DeviceMemory, LanguageShape, activation_reserve, auto_kv_cache_bytes, check_max_model_len, embedding_bytes,
    forward_peak_bytes)

AUTO = "auto"
# --kv-cache-mib auto off CUDA: enough for tests and a few requests on a
# laptop (~7k tokens of a 3B model); there is no device memory to size from.
CPU_KV_CACHE_MIB = 256


def kv_cache_mib_arg(text: str) -> int | str:
    if text == AUTO:
        return AUTO
    return at_least_one(text, "MiB", ", or auto")


def utilization_arg(text: str) -> float:
    try:
        share = float(text)
    except ValueError:
        share = 0.0
    if not 0 < share <= 1:   # also false for nan
        raise argparse.ArgumentTypeError(f"{text!r}: want a share of the GPU's memory in (0, 1], e.g. 0.9")
    return share


def check_context(args: argparse.Namespace, model: torch.nn.Module, kv_bytes: int, sized_by: str) -> None:
    """ValueError unless --max-model-len suits the checkpoint and the KV
    cache holds one request of it; before the engine captures its graphs."""
    shape = language_shape(model)
    if args.max_model_len is not None and args.max_model_len > shape.max_context:
        raise ValueError(f"--max-model-len {args.max_model_len}: this checkpoint takes 1 to {shape.max_context} tokens")
    check_max_model_len(kv_bytes, shape.kv_bytes_per_token, args.block_size, args.max_model_len or shape.max_context,
                        sized_by)


def language_shape(model: torch.nn.Module) -> LanguageShape:
    lang = model.spec.language
    return LanguageShape(lang.num_layers, lang.kv_heads, lang.head_dim, lang.hidden_size, lang.intermediate_size,
                         lang.vocab_size, lang.max_context, next(model.parameters()).element_size())


def kv_cache_bytes(args: argparse.Namespace, model: torch.nn.Module, device: torch.device) -> tuple[int, str]:
    """The KV cache's bytes from --kv-cache-mib, and how they were chosen (for
    the log). Call with the weights on the device and nothing else yet."""
    if args.kv_cache_mib != AUTO:
        return args.kv_cache_mib << 20, f"--kv-cache-mib {args.kv_cache_mib}"
    if device.type != "cuda":
        return CPU_KV_CACHE_MIB << 20, f"--kv-cache-mib auto on {device.type}"
    vision, shape = model.spec.vision, language_shape(model)
    dtype_bytes = shape.dtype_bytes
    vision_bytes = 0
    if args.mode == "aggregated" or args.encode_fallback == "local":
        patches = args.local_encode_tokens * vision.patches_per_token
        vision_bytes = forward_peak_bytes(patches, vision.hidden_size, vision.intermediate_size, dtype_bytes)
        vision_bytes += args.media_budget_mib << 20   # decoded media wait on the device (receive)
    spec = model.spec
    embeddings = embedding_bytes(args.encoder_cache_tokens, spec.embedding_width, shape.hidden_size,
                                 spec.side_levels, args.max_num_batched_tokens, dtype_bytes)
    reserve = activation_reserve(shape, args.max_num_batched_tokens, args.max_num_seqs, vision_bytes, embeddings)
    # Loading leaves freed staging buffers in torch's cache: hand them back,
    # so that what the allocator holds is the weights and `free` is true.
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    memory = DeviceMemory(total, free, torch.cuda.memory_reserved(device))
    kv_bytes = auto_kv_cache_bytes(memory, args.gpu_memory_utilization, reserve, shape.kv_bytes_per_token,
                                   args.max_num_batched_tokens, args.block_size)
    return kv_bytes, (f"--kv-cache-mib auto: {args.gpu_memory_utilization:g} of {total / GIB:.1f} GiB, "
                      f"{free / GIB:.1f} GiB free; weights {memory.held / GIB:.1f} GiB, "
                      f"{reserve / GIB:.1f} GiB kept for activations, CUDA graphs and image embeddings")
