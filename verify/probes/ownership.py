"""Ownership probe: after sharding, record who owns each parameter (the engine view's
OwnershipMap; FSDP2's is put together from every rank's part in the case's one gather), which
parameter names share one tensor in the sharded module (ties), and whether the optimizer holds
exactly the tensors the sharded module trains. All of it goes into trace.meta as JSON;
verify/checks/ownership.py judges it."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_verify import module_names
from fsdp_verify.engines.fsdp2_ownership import local_holdings, ownership_from
from fsdp_verify.engines.view import EngineView
from fsdp_verify.probes.base import Probe


def gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order (a collective)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def tie_groups(module: nn.Module) -> list[list[str]]:
    """Parameter names that resolve to one tensor, for every tensor registered under 2+ names."""
    by_tensor: dict[int, list[str]] = {}
    for name, p in module_names.named_parameters(module, remove_duplicate=False):
        by_tensor.setdefault(id(p), []).append(name)
    return [names for names in by_tensor.values() if len(names) > 1]


class OwnershipProbe(Probe):
    def after_shard(self, model: nn.Module, view: EngineView) -> None:
        self.module = model
        self.holdings = None
        if type(view).ownership is EngineView.ownership:
            # FSDP2's map: each rank reads its part now, the case's one gather brings them together
            self.holdings = local_holdings(model)
        else:
            ownership = view.ownership()  # the engine's own reading, a collective: every rank calls it
            self.meta("ownership", ownership.to_json() if ownership is not None else None)
        self.meta("ties", tie_groups(model))

    def after_optimizer(self, optimizer: torch.optim.Optimizer, view: EngineView) -> None:
        held = [p for group in optimizer.param_groups for p in group["params"]]
        held_ids = {id(p) for p in held}
        view_params = view.parameters()
        view_ids = {id(p) for p in view_params.values()}
        module_ids = {id(p) for p in self.module.parameters()}
        mine = {
            # tensors the optimizer steps that the view does not expose
            "foreign": sum(1 for p in held if id(p) not in view_ids),
            # parameters the view exposes that the optimizer does not step
            "not_stepped": [n for n, p in view_params.items() if id(p) not in held_ids],
            # parameters the optimizer steps that the sharded module does not compute with
            # (e.g. the pre-sharding tensors `fully_shard` replaced)
            "stale": [n for n, p in view_params.items() if id(p) in held_ids and id(p) not in module_ids],
        }
        self.optimizer_params = mine

    def to_gather(self):
        return getattr(self, "holdings", None), getattr(self, "optimizer_params", None)

    def gathered(self, per_rank) -> None:
        holdings, optimizer_params = zip(*per_rank)
        if holdings[self.rank] is not None:
            ownership = ownership_from(list(holdings))
            self.meta("ownership", ownership.to_json() if ownership is not None else None)
        if optimizer_params[self.rank] is not None:
            self.meta("optimizer_params", list(optimizer_params))
