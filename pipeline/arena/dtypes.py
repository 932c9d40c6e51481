"""Tensor dtypes by the names that travel in handles."""

from __future__ import annotations

import torch

BY_NAME = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
NAMES = {v: k for k, v in BY_NAME.items()}


def dtype_name(dtype: torch.dtype) -> str:
    if dtype not in NAMES:
        raise ValueError(f"dtype {dtype} cannot be stored in an arena")
    return NAMES[dtype]


def dtype_from_name(name: str) -> torch.dtype:
    if name not in BY_NAME:
        raise ValueError(f"unknown arena dtype {name!r}")
    return BY_NAME[name]
