"""Per-parameter shard placements, FSDP2's `shard_placement_fn`, as a Case names them
(`shard_placement`): one rule that the engine, the reference and the resource contracts all read,
so a Shard(1) parameter is sharded, reduced, reassembled and budgeted the same way everywhere.

- `dim0`: FSDP2's default, Shard(0) for every parameter (no `shard_placement_fn`).
- `dim1`: Shard(1) for every parameter of two or more dimensions whose dim 1 the shard group
  divides; Shard(0) for the rest (vectors, and uneven or too narrow dim 1).
- `mixed`: `dim1`'s rule for about half the eligible parameters (by a hash of the name, so it
  does not depend on registration order), Shard(0) for the others: mixed placements in a unit.

Why only an even dim 1: FSDP2 pads an uneven Shard(0) but its reduce-scatter refuses an uneven
Shard(i), i > 0 (`foreach_reduce`: "Shard(1) requires even sharding", torch 2.13) — a stated
limitation, not a bug, so a user's placement function has to fall back as this one does. Uneven
sizes and dimensions smaller than the shard group (ranks holding empty shards) are then Shard(0)
parameters in the same units.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

PLACEMENTS = ("dim0", "dim1", "mixed")


def shard_dim(rule: str, name: str, shape: tuple[int, ...] | list[int], shard: int) -> int:
    """The tensor dimension parameter `name` of `shape` is sharded on over a shard group of `shard`."""
    if rule == "dim0" or len(shape) < 2 or shape[1] % shard:
        return 0
    if rule == "mixed" and zlib.crc32(name.encode()) % 2:
        return 0
    return 1


def placement_fn(rule: str, model, shard: int) -> Callable | None:
    """FSDP2's `shard_placement_fn` for `model` (called before any `fully_shard`: it names the
    parameters by their FQN in the whole model); None for `dim0`."""
    if rule == "dim0":
        return None
    from torch.distributed.tensor import Shard

    names = {id(p): n for n, p in model.named_parameters()}

    def fn(param):
        return Shard(shard_dim(rule, names.get(id(param), ""), tuple(param.shape), shard))

    return fn
