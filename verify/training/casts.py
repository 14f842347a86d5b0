"""The casts FSDP2's MixedPrecisionPolicy performs on a unit's inputs and outputs."""

from __future__ import annotations

from typing import Any

import torch


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
