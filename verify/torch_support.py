"""The torch this runs on: the oldest release the toolkit supports, and the private torch names it
reaches for, each feature-tested, so a release that lacks one degrades (a fallback, or the one
part that needs it off with a note) or is refused as bad input (exit 2, naming the release and
what it lacks), never a rank failure. A release below the minimum is refused first, with what is
known to go wrong on it: its missing names are symptoms, not the reason.

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
from dataclasses import dataclass

MINIMUM = (2, 11)

# What is known to go wrong on a release below the minimum, said before anything else (a missing
# private name is a symptom of the old release, not the reason to give).
KNOWN_PROBLEMS: dict[tuple[int, int], str] = {
    (2, 6): (
        "FSDP2 cannot run on the CPU at all ('Stream' has no `record_event`: every rank fails in the first forward)"
    ),
    (2, 8): (
        "FSDP2 over gloo sums the ranks' gradients instead of averaging them (pytorch/pytorch#162338,"
        " fixed in 2.9; tests/upstream/test_fsdp2_gloo_averages_gradients.py), so every check of a correct"
        " engine would diverge"
    ),
    (2, 9): (
        "the communication contract cannot attribute FSDP2's reduce-scatters to units (118 false alarms"
        " in a 200-case sweep)"
    ),
}


def _release(version: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


# The parts of the toolkit a private name may be all that needs it: without the name that part
# is off, with a note, and the user's own check still runs. RUN: the run itself needs it (refused).
RUN = "the run"
ZOO_COMM = "the bug zoo's comm mutants"
COMM_CONTRACT = "the communication contract"
RECORDER = "the Recorder"


@dataclass(frozen=True)
class PrivateName:
    module: str
    attribute: str
    user: str  # what needs it
    part: str = RUN  # what is off without it (RUN: nothing can run)

    def __str__(self) -> str:
        return f"{self.module}.{self.attribute} ({self.user})"


# The private torch names the toolkit needs, feature-tested before any rank starts. A name missing
# from a release is bad input naming the release and the name, not an ImportError on every rank, or,
# where only a part needs it, that part off with a note. Private names with a fallback (the DTensor
# caches below, FSDP2's `_fsdp_param_groups` read with getattr, the zoom's dispatch mode, the memory
# probe's DTensorSpec/TensorMeta and tree_leaves) are not listed.
PRIVATE_NAMES: tuple[PrivateName, ...] = (
    PrivateName("torch.utils._pytree", "tree_flatten", "the reference's and the flat engine's argument handling"),
    PrivateName(
        "torch.distributed._functional_collectives",
        "all_reduce",
        "the communication probe: DTensor's collectives (the clip norm's all-reduce)",
        COMM_CONTRACT,
    ),
    PrivateName(
        "torch.distributed.tensor._utils",
        "compute_local_shape_and_global_offset",
        "the Recorder's shard offsets",
        RECORDER,
    ),
    PrivateName("torch.distributed.fsdp._common_utils", "clean_tensor_name", "the fsdp1 engine's parameter names"),
    PrivateName(
        "torch.distributed.fsdp._fully_shard._fsdp_collectives",
        "DefaultReduceScatter",
        "the bug zoo's comm mutants",
        ZOO_COMM,
    ),
    PrivateName(
        "torch.distributed.fsdp._fully_shard._fsdp_collectives",
        "DefaultAllGather",
        "the bug zoo's comm mutants",
        ZOO_COMM,
    ),
    PrivateName("torch.distributed.fsdp", "FSDPModule._get_fsdp_state", "FSDP2's units (ownership, contracts)"),
    PrivateName("torch.autograd", "_unsafe_preserve_version_counter", "the flat engine's parameter views"),
    PrivateName("torch._C", "_current_graph_task_id", "the flat engine's backward hooks"),
)


def private_name(module: str, attribute: str):
    """The private name's object, or None where this torch lacks it."""
    import importlib

    try:
        found = importlib.import_module(module)
        for part in attribute.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError):
        return None
    return found


def missing_private_names(part: str | None = None) -> list[PrivateName]:
    """The PRIVATE_NAMES this torch lacks (those `part` needs, where given)."""
    return [
        n for n in PRIVATE_NAMES if (part is None or n.part == part) and private_name(n.module, n.attribute) is None
    ]


def parts_off() -> dict[str, list[PrivateName]]:
    """The parts this torch turns off (not RUN), each with the names it lacks."""
    off: dict[str, list[PrivateName]] = {}
    for name in missing_private_names():
        if name.part != RUN:
            off.setdefault(name.part, []).append(name)
    return off


def part_off_note(part: str) -> str | None:
    """Why `part` is off on this torch, or None when it is on."""
    missing = missing_private_names(part)
    if not missing:
        return None
    import torch

    return f"{part}: off, torch {torch.__version__} lacks {'; '.join(map(str, missing))}"


def unsupported_torch(version: str | None = None) -> str | None:
    """Why this torch cannot run fsdp-verify, or None when it can: the release first (a release
    below the minimum, with what is known to go wrong on it), then a private name the run itself
    needs. A name only a part needs is not a reason (see parts_off)."""
    check_names = version is None
    if version is None:
        import torch

        version = torch.__version__
    release = _release(version)
    if release < MINIMUM:
        known = KNOWN_PROBLEMS.get(release)
        reason = (
            f"on {release[0]}.{release[1]}, {known}"
            if known
            else "the oldest release whose 200-case sweep raised no false alarm (docs/torch-versions.md); before"
            " it, FSDP2 over gloo sums the ranks' gradients (2.8, pytorch/pytorch#162338) or cannot run on the"
            " CPU at all (2.6), and the communication contract misreads FSDP2's collectives (2.9)"
        )
        return (
            f"torch {version} is older than the oldest release fsdp-verify supports"
            f" ({MINIMUM[0]}.{MINIMUM[1]}): {reason}; install torch>={MINIMUM[0]}.{MINIMUM[1]}"
        )
    if check_names:
        missing = missing_private_names(RUN)
        if missing:
            return f"torch {version} lacks what fsdp-verify reaches for: {'; '.join(map(str, missing))}"
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
