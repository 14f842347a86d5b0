"""Random streams: which seed drives what, identically on the reference and the sharded side."""

from __future__ import annotations

import hashlib

import torch

from fsdp_verify.case import Case


def dropout_seed(case: Case, rank: int) -> int:
    """Seed of data-parallel rank `rank`'s global generator (dropout masks). Distinct per rank:
    ranks that share a dropout mask are a bug the toolkit must see."""
    return (case.seed * 7919 + 104729 * (rank + 1)) % (2**63)


def dropout_states(case: Case) -> list[torch.Tensor]:
    """Every data-parallel rank's first CPU generator state, for the reference to replay: a
    fresh generator's (`torch.manual_seed` gives the same state but seeds every device type as
    well, a tenth of a millisecond a call)."""
    return [torch.Generator().manual_seed(dropout_seed(case, r)).get_state() for r in range(case.dp_size)]


def rank_streams(case: Case, states: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every rank's generator state in rank order, from the data-parallel ranks' `states`: each
    rank draws from its data-parallel rank's stream (seeded by it, verify/sharded/loop.py), its tp
    ranks and a pipeline's later stages alike (nothing draws there: dropout is refused beside a
    pipeline). What a resume carries rank by rank (docs/resume.md)."""
    dims = case.parallel
    return [states[dims.dp_rank(r)] for r in range(case.world_size)]


def rng_fingerprint(state: torch.Tensor) -> int:
    """A 63-bit hash of a generator state (`torch.get_rng_state()`), for the trace: two runs
    that draw the same stream have the same fingerprints at the same points."""
    digest = hashlib.sha256(state.contiguous().view(torch.uint8).numpy().tobytes()).digest()
    return int.from_bytes(digest[:8], "little") >> 1
