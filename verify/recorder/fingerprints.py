"""Cheap fingerprints of tensors, computed on the rank that holds them.

Per tensor we keep, for each slice along dim 0 (a "row"), its sum and its sum of squares, stored
in float64 (gradients, and the initial parameters), or its total sum and sum of squares (parameters
after an update and optimizer state, see `total_stats`). Why rows: FSDP2 shards parameters, gradients and optimizer state along dim 0, so a rank's
rows are an exact slice of the reference's rows and `compare` can put them back in place without
any rank gathering the model; why float64 where a rule needs it: the values are fp32 or coarser, so a
float64 sum is exact up to the order the terms are added in, and a fingerprint then moves only
when the values move. That is needed by the records held to the exact rule (step 0) and the
bound (the first optimizer step's gradients, the logits before it), and costs a conversion of
every element (4 ns each on one CPU core: 3.5 ms per pass over the medium Transformer, 25% of
its training step over the four passes of an Adam step). Later records are held to calibrated
limits (at least 1.07e-6, and the perturbed rerun's fingerprints round alike), which a
fingerprint accumulated in the tensor's own fp32 (error about u log2(row length), 5e-7 at worst,
1e-7 typically) leaves intact, at a fifth of the cost. Totals (the param sums of seed 004) are sums of rows. A gradient scaled by 1 + 2e-6 on one
rank moves its rows' norms by 2e-6, which a whole-tensor sum would blur with the other ranks'.

Batches are fingerprinted per sample (a hash of each row's bytes over every tensor of the batch),
so `compare` can tell which samples each rank saw.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import numpy as np
import torch


def local_view(t: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(the local tensor, its first row in the full tensor, the full tensor's rows). A DTensor
    sharded along dim 0 on one mesh dim (FSDP2's Shard(0)) or replicated gives its local rows; a
    tensor-parallel run's 2-D shards (a `_StridedShard` of the rows, or columns) are gathered
    whole: `full_tensor()`, a collective every rank issues in the same order, the Recorder's only."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t, 0, (t.shape[0] if t.ndim else 1)
    if not rows_only(t.placements):
        return t.full_tensor(), 0, (t.shape[0] if t.ndim else 1)
    from fsdp_verify.torch_support import RECORDER, part_off_note, private_name

    offsets = private_name("torch.distributed.tensor._utils", "compute_local_shape_and_global_offset")
    if offsets is None:
        raise RuntimeError(part_off_note(RECORDER))
    shape, offset = offsets(t.shape, t.device_mesh, t.placements)
    local = t.to_local()
    if any(offset[1:]) or tuple(shape[1:]) != tuple(t.shape[1:]):
        raise ValueError(f"placements {t.placements}: only sharding along dim 0 (FSDP2's Shard(0)) is supported")
    return local, (offset[0] if t.ndim else 0), (t.shape[0] if t.ndim else 1)


def rows_only(placements) -> bool:
    """Whether a DTensor's local part is a block of its rows: replicated but for one plain
    Shard(0) (not a `_StridedShard`, whose rows interleave with another dim's)."""
    from torch.distributed.tensor import Replicate, Shard

    sharded = [p for p in placements if not isinstance(p, Replicate)]
    return not sharded or (len(sharded) == 1 and type(sharded[0]) is Shard and sharded[0].dim == 0)


def as_rows(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(1, 1) if t.ndim == 0 else t.detach().reshape(t.shape[0], -1)


def row_stats(tensors: Sequence[torch.Tensor], exact: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Row sums and row sums of squares of every tensor, concatenated, stored in float64 on the
    CPU (accumulated in float64 if `exact`, else in the tensor's dtype): one transfer for all
    tensors, not one `.item()` per parameter."""
    if not tensors:
        empty = torch.zeros(0, dtype=torch.float64)
        return empty, empty
    sums, squares = [], []
    for t in tensors:
        rows = as_rows(t)
        acc = torch.float64 if exact else None
        sums.append(rows.sum(dim=1, dtype=acc))
        squares.append(torch.linalg.vector_norm(rows, 2, dim=1, dtype=acc).square())
    both = torch.cat([torch.cat(sums), torch.cat(squares)]).double().cpu()
    n = both.numel() // 2
    return both[:n].clone(), both[n:].clone()  # two storages: safetensors refuses shared ones


def total_stats(tensors: Sequence[torch.Tensor], sums: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each tensor's sum and sum of squares (one "row" per tensor), accumulated in its own dtype:
    the squares by one fused kernel, the sums one kernel each, so only the first `sums` tensors
    get one (the parameters after an update: seed 004's param sums; optimizer state is recorded
    by its norm, its sum stored as 0). For records that need no row to localise (judged by
    calibration; the gradients' rows localise a bug first) at a fifth of `row_stats`' cost."""
    if not tensors:
        empty = torch.zeros(0, dtype=torch.float64)
        return empty, empty
    n = len(tensors)
    sums = n if sums is None else sums
    norms = torch._foreach_norm(list(tensors), 2) if hasattr(torch, "_foreach_norm") else [t.norm() for t in tensors]
    parts = [t.sum() for t in tensors[:sums]] + [n.square() for n in norms]
    both = torch.stack(parts).double().cpu()
    return torch.cat([both[:sums], torch.zeros(n - sums, dtype=torch.float64)]), both[sums:].clone()


def _batch_tensors(batch) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        return [t for _, t in sorted(batch.items()) if isinstance(t, torch.Tensor)]
    if isinstance(batch, Sequence) and not isinstance(batch, (str, bytes)):
        return [t for t in batch if isinstance(t, torch.Tensor)]
    raise TypeError(f"batch: expected a tensor, or a dict, tuple or list of tensors, got {type(batch).__name__}")


def sample_hashes(batch) -> torch.Tensor:
    """An int64 per sample (dim 0): blake2b of the sample's bytes in every tensor of the batch."""
    tensors = [t.detach().contiguous().cpu() for t in _batch_tensors(batch)]
    if not tensors:
        raise TypeError("batch: holds no tensor")
    n = tensors[0].shape[0] if tensors[0].ndim else 1
    for t in tensors:
        if (t.shape[0] if t.ndim else 1) != n:
            raise ValueError(f"batch: tensors disagree on the number of samples (dim 0): {n} and {t.shape[0]}")
    rows = [t.reshape(n, -1).view(torch.uint8).numpy() if t.numel() else np.zeros((n, 0), np.uint8) for t in tensors]
    out = np.empty(n, dtype="<i8")
    for i in range(n):
        h = hashlib.blake2b(digest_size=8)
        for r in rows:
            h.update(r[i].tobytes())
        out[i] = np.frombuffer(h.digest(), dtype="<i8")[0]
    return torch.from_numpy(out)
