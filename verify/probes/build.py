"""Build probe: what the model factory built on each rank, before the engine sees it. Every rank
must build the same model (the same parameters, shapes and values, under the same seed); a
factory that draws unseeded randomness or sizes by rank breaks that, and sharding such a model
compares nothing meaningful (different shapes may even hang a collective). Each rank's list of
(name, shape, dtype, value hash) goes into trace.meta["build"]; when shapes differ the loop
stops before sharding (`stop`), and the check (verify/checks/build.py) names the first one.
The ranks first compare a digest of their lists (one small all-gather); only when the digests
differ do the lists themselves travel."""

from __future__ import annotations

import hashlib
import json

import torch.distributed as dist
from torch import nn

from fsdp_verify.probes.base import Probe
from fsdp_verify.probes.buffers import tensor_hash
from fsdp_verify.probes.ownership import gather_objects
from fsdp_verify.sharded.gather import all_gather_ints


def fingerprint(model: nn.Module) -> list[tuple[str, list[int], str, str]]:
    return [(n, list(p.shape), str(p.dtype), tensor_hash(p)) for n, p in model.named_parameters()]


class BuildProbe(Probe):
    stop = False

    def after_build(self, model: nn.Module) -> None:
        mine = fingerprint(model)
        if _same_on_every_rank(mine):  # the common case: one all-gather of 32 bytes, no pickling
            per_rank = [mine] * self.world_size
        else:  # the lists themselves, for the check to name the first difference
            per_rank = gather_objects(mine)
        self.meta("build", per_rank)
        shapes = [[(n, s) for n, s, _, _ in params] for params in per_rank]
        self.stop = any(s != shapes[0] for s in shapes[1:])


def _same_on_every_rank(fingerprint: list) -> bool:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return True
    digest = hashlib.sha256(json.dumps(fingerprint).encode()).digest()
    mine = [int.from_bytes(digest[i : i + 8], "little", signed=True) for i in range(0, 32, 8)]
    return all(theirs == mine for theirs in all_gather_ints(mine))
