"""Build probe: what the model factory built on each rank, before the engine sees it. Every rank
must build the same model (the same parameters, shapes and values, under the same seed); a
factory that draws unseeded randomness or sizes by rank breaks that, and sharding such a model
compares nothing meaningful (different shapes may even hang a collective). Each rank's list of
(name, shape, dtype, value hash) goes into trace.meta["build"]; when shapes differ the loop
stops before sharding (`stop`), and the check (verify/checks/build.py) names the first one."""

from __future__ import annotations

from torch import nn

from fsdp_verify.probes.base import Probe
from fsdp_verify.probes.buffers import tensor_hash
from fsdp_verify.probes.ownership import gather_objects


def fingerprint(model: nn.Module) -> list[tuple[str, list[int], str, str]]:
    return [(n, list(p.shape), str(p.dtype), tensor_hash(p)) for n, p in model.named_parameters()]


class BuildProbe(Probe):
    stop = False

    def after_build(self, model: nn.Module) -> None:
        per_rank = gather_objects(fingerprint(model))
        self.meta("build", per_rank)
        shapes = [[(n, s) for n, s, _, _ in params] for params in per_rank]
        self.stop = any(s != shapes[0] for s in shapes[1:])
