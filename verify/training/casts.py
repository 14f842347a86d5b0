"""The casts FSDP2's MixedPrecisionPolicy performs on a unit's inputs and outputs."""

from __future__ import annotations

import dataclasses
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
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):  # transformers' ModelOutput
        return dataclasses.replace(
            obj, **{f.name: cast_floats(getattr(obj, f.name), dtype) for f in dataclasses.fields(obj)}
        )
    if isinstance(obj, dict):
        return (
            type(obj)((k, cast_floats(v, dtype)) for k, v in obj.items())
            if type(obj) is not dict
            else {k: cast_floats(v, dtype) for k, v in obj.items()}
        )
    return obj
