"""Random streams: which seed drives what, identically on the reference and the sharded side."""

from __future__ import annotations

from verify.case import Case


def dropout_seed(case: Case, rank: int) -> int:
    """Seed of data-parallel rank `rank`'s global generator (dropout masks). Distinct per rank:
    ranks that share a dropout mask are a bug the toolkit must see."""
    return (case.seed * 7919 + 104729 * (rank + 1)) % (2**63)
