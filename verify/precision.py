"""Dtype names <-> torch dtypes, and the casts FSDP2's MixedPrecisionPolicy performs."""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from verify.case import PrecisionSpec

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def to_dtype(name: str | None) -> torch.dtype | None:
    return None if name is None else _DTYPES[name]


def mp_policy(spec: PrecisionSpec) -> MixedPrecisionPolicy:
    return MixedPrecisionPolicy(
        param_dtype=to_dtype(spec.param_dtype),
        reduce_dtype=to_dtype(spec.reduce_dtype),
        output_dtype=to_dtype(spec.output_dtype),
        cast_forward_inputs=spec.cast_forward_inputs,
    )


def cast_floats(obj: Any, dtype: torch.dtype) -> Any:
    """Cast every floating-point tensor in a nested args structure, as FSDP2's _cast_fp_tensor."""
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if torch.is_floating_point(obj) else obj
    if isinstance(obj, tuple):
        return tuple(cast_floats(o, dtype) for o in obj)
    if isinstance(obj, list):
        return [cast_floats(o, dtype) for o in obj]
    if isinstance(obj, dict):
        return {k: cast_floats(v, dtype) for k, v in obj.items()}
    return obj
