"""The torch this runs on: the oldest release the toolkit supports, and the private torch names it
reaches for, each feature-tested with a fallback, so a release that lacks one degrades or is
refused as bad input (exit 2, naming the release and what it lacks), never a rank failure.

Measured on CPU/gloo (docs/torch-versions.md): 2.6 cannot run FSDP2 on the CPU at all ('Stream'
has no `record_event`, every rank fails in the first forward); 2.8's FSDP2 over gloo sums the
ranks' gradients instead of averaging them (pytorch/pytorch#162338, fixed in 2.9; the repro is
tests/upstream/test_fsdp2_gloo_averages_gradients.py); 2.9.1 passes the default check but the
communication contract cannot attribute its FSDP2's reduce-scatters to units (118 false alarms
in the gate's 200-case sweep); 2.11.0, 2.13.0 and 2.14.1 pass the same sweep with none (2.11
catches 22 of the zoo's 31 bugs at world size 2, 2.13 and 2.14 27). CUDA builds have not been
tried (no GPU here)."""

from __future__ import annotations

import re

MINIMUM = (2, 11)


def _release(version: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def unsupported_torch(version: str | None = None) -> str | None:
    """Why this torch cannot run fsdp-verify, or None when it can."""
    if version is None:
        import torch

        version = torch.__version__
    if _release(version) < MINIMUM:
        return (
            f"torch {version} is older than the oldest release fsdp-verify supports"
            f" ({MINIMUM[0]}.{MINIMUM[1]}): before it, the communication contract misreads FSDP2's"
            " collectives (2.9: false alarms), FSDP2 over gloo sums the ranks' gradients instead of"
            " averaging them (2.8, pytorch/pytorch#162338) or cannot run on the CPU at all (2.6);"
            " install torch>="
            f"{MINIMUM[0]}.{MINIMUM[1]}"
        )
    return None


def clear_dtensor_caches() -> None:
    """Drop DTensor's sharding-propagation and redistribute-planner caches, which hold a case's
    meshes (and so its process groups) alive. Both are private; a release without one has no such
    cache to clear (torch 2.9 has no redistribute planner cache)."""
    try:
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    except ImportError:
        _clear_sharding_prop_cache = None
    try:
        from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache
    except ImportError:
        clear_redistribute_planner_cache = None
    for clear in (_clear_sharding_prop_cache, clear_redistribute_planner_cache):
        if clear is not None:
            clear()
