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


# The private torch names the toolkit needs, feature-tested before any rank starts: (module,
# attribute, what needs it). A name missing from a release is bad input naming the release and
# the name, not an ImportError on every rank. Private names with a fallback (the DTensor caches
# below, FSDP2's `_fsdp_param_groups` read with getattr, the zoom's dispatch mode) are not listed.
PRIVATE_NAMES: tuple[tuple[str, str, str], ...] = (
    ("torch.utils._pytree", "tree_flatten", "the reference's and the flat engine's argument handling"),
    ("torch.utils._pytree", "tree_leaves", "the memory probe"),
    ("torch.distributed._functional_collectives", "all_reduce", "the communication probe"),
    ("torch.distributed.tensor._dtensor_spec", "DTensorSpec", "the memory probe"),
    ("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset", "the Recorder's shard offsets"),
    ("torch.distributed.fsdp._common_utils", "clean_tensor_name", "the fsdp1 engine's parameter names"),
    ("torch.distributed.fsdp._fully_shard._fsdp_collectives", "DefaultReduceScatter", "the bug zoo's comm mutants"),
    ("torch.distributed.fsdp._fully_shard._fsdp_collectives", "DefaultAllGather", "the bug zoo's comm mutants"),
    ("torch.distributed.fsdp", "FSDPModule._get_fsdp_state", "FSDP2's units (ownership, contracts)"),
    ("torch.autograd", "_unsafe_preserve_version_counter", "the flat engine's parameter views"),
    ("torch._C", "_current_graph_task_id", "the flat engine's backward hooks"),
)


def missing_private_names() -> list[str]:
    """The PRIVATE_NAMES this torch lacks, each as 'module.attribute (what needs it)'."""
    import importlib

    missing = []
    for module, attribute, user in PRIVATE_NAMES:
        try:
            found = importlib.import_module(module)
            for part in attribute.split("."):
                found = getattr(found, part)
        except (ImportError, AttributeError):
            missing.append(f"{module}.{attribute} ({user})")
    return missing


def unsupported_torch(version: str | None = None) -> str | None:
    """Why this torch cannot run fsdp-verify, or None when it can."""
    if version is None:
        import torch

        version = torch.__version__
        missing = missing_private_names()
        if missing:
            return f"torch {version} lacks what fsdp-verify reaches for: {'; '.join(missing)}"
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
