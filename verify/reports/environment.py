"""The environment a report was made in: what `report diff` blames when numbers move with no
code change (a new torch, CUDA or NCCL, another GPU, another fsdp-verify)."""

from __future__ import annotations

import platform
import sys
from importlib import metadata
from typing import Any


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def environment() -> dict[str, Any]:
    """Versions and hardware; null where there is none (no CUDA on a CPU runner)."""
    import torch

    cuda = torch.version.cuda
    nccl = gpu = None
    if torch.cuda.is_available():
        try:
            nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
        except (AttributeError, RuntimeError):
            nccl = None
        gpu = torch.cuda.get_device_name(0)
    return {
        "fsdp_verify": _version("fsdp-verify"),
        "torch": torch.__version__,
        "cuda": cuda,
        "nccl": nccl,
        "gpu": gpu,
        "hypothesis": _version("hypothesis"),
        "python": platform.python_version(),
        "platform": f"{sys.platform} {platform.machine()}",
    }
