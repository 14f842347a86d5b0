from __future__ import annotations

import os
from pathlib import Path

import pytest

from fsdp_verify.case import Case, ModelSpec
from fsdp_verify.case_specs import DataSpec

# Small, fast cases. Widths are chosen so no shard is even: 33 and 17 rows over 2, 3 or 4 ranks.
MLP = ModelSpec(kind="mlp", widths=(16, 33, 17, 8))
TINY_LM = ModelSpec(kind="transformer", vocab_size=61, dim=16, n_layers=2, n_heads=2, ffn_hidden=23, seq_len=6)


def mlp_case(world_size: int = 2, **changes) -> Case:
    changes.setdefault("data", DataSpec(batch_size=world_size * changes.get("microbatches", 1) * 2))
    changes.setdefault("steps", 2)
    return Case(model=MLP, world_size=world_size, **changes)


def lm_case(world_size: int = 2, **changes) -> Case:
    changes.setdefault("data", DataSpec(batch_size=world_size * changes.get("microbatches", 1) * 2))
    changes.setdefault("steps", 2)
    return Case(model=TINY_LM, world_size=world_size, **changes)


def require(module: str):
    """Import an optional dependency: skipped on a developer's machine without it, a failure under
    CI, which installs every extra (a skipped assertion there would be a defect)."""
    if os.environ.get("CI", "").strip().lower() not in ("", "0", "false"):
        import importlib

        return importlib.import_module(module)
    return pytest.importorskip(module)


def regression(case_hash: str) -> Case:
    """A pinned case from tests/regressions/ (see its README), for a property test's @example."""
    return Case.load(Path(__file__).parent / "regressions" / f"{case_hash}.json")


def children_of(pid: int) -> list[int]:
    """Live child processes of `pid` (from /proc), to prove none is left behind."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
                    out.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
    return out


def descendants_of(pid: int) -> list[int]:
    """Live processes below `pid`: its children, theirs, and so on (a pool's ranks are children of
    its zygote, verify/sharded/zygote.py)."""
    found, frontier = [], [pid]
    while frontier:
        below = [c for p in frontier for c in children_of(p)]
        found += below
        frontier = below
    return found


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


@pytest.fixture
def no_leftover_children():
    before = set(descendants_of(os.getpid()))
    yield
    leftover = set(descendants_of(os.getpid())) - before
    assert not leftover, f"processes left behind: {sorted(leftover)}"
