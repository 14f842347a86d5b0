"""Knobs probe: right after the engine returns, whether it applied every engine-side knob the
case asks for and it declares (verify/engines/applied.py). If any rank finds one not applied the
loop stops before the first step (`stop`, on every rank alike), and the check
(verify/checks/knobs.py) names the knob and the evidence instead of the crash or divergence the
run would have gone on to."""

from __future__ import annotations

from torch import nn

from fsdp_verify.engines.view import EngineView
from fsdp_verify.probes.base import Probe
from fsdp_verify.sharded.gather import all_gather_ints


class KnobsProbe(Probe):
    stop = False

    def after_shard(self, model: nn.Module, view: EngineView) -> None:
        from fsdp_verify.engines import engine_capabilities
        from fsdp_verify.engines.applied import not_applied
        from fsdp_verify.engines.capabilities import TAKEABLE

        takes = engine_capabilities(self.case.engine).takes
        if not any(k.asked(self.case) and k.name in takes for k in TAKEABLE.values()):
            return  # nothing to read (the same on every rank): no collective
        missing = not_applied(self.case, model, takes)
        counts = all_gather_ints([len(missing)]) if self.world_size > 1 else [[len(missing)]]
        self.stop = any(c[0] for c in counts)
        if self.stop and self.world_size > 1:  # every rank's findings: rank 0 reports the first rank's
            import torch.distributed as dist

            found: list = [None] * self.world_size
            dist.all_gather_object(found, [list(m) for m in missing])
            if not missing:
                rank = next(r for r, f in enumerate(found) if f)
                missing = [(knob, f"rank {rank}: {why}") for knob, why in found[rank]]
        if missing:
            self.meta("knobs_not_applied", [list(m) for m in missing])
