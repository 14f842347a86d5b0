"""FSDP2's ownership map, read from the `fully_shard` state of every FSDPModule.

Each FSDPModule holds param groups of FSDPParams; an FSDPParam knows the module and attribute it
was registered on (plus any modules sharing it: tied weights), its original size and its padded
local shard. The shard unit of a parameter is the FQN of the module `fully_shard` was called on.
A parameter of the returned module that no FSDPParam holds is unmanaged (FSDP2 would leave it
replicated and unsynchronised). Local sizes differ per rank, so reading the map is a collective.
"""

from __future__ import annotations

import math

import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule

from fsdp_verify import module_names, units
from fsdp_verify.engines.ownership import OwnershipMap, ParamOwnership


def _param_groups(state) -> list:
    groups = getattr(state, "_fsdp_param_groups", None)  # torch >= 2.10: several per module
    if groups is None:
        group = getattr(state, "_fsdp_param_group", None)
        groups = [group] if group is not None else []
    return list(groups)


def unit_states(root: nn.Module) -> list[tuple[str, object]]:
    """Each `fully_shard` call's state in `root`, once, with the unit's name as the engine built it:
    the FQN of the module it was called on, or, for one call over several modules
    (`fully_shard([norm, lm_head])`, one state shared by all of them), their FQNs joined by '+' in
    the order given (verify/units.py). Read from the modules' FSDP state, not from the wrap plan."""
    module_fqn = {id(m): name for name, m in module_names.named_modules(root, remove_duplicate=False)}
    seen: set[int] = set()
    out = []
    for name, module in module_names.named_modules(root):
        if not isinstance(module, FSDPModule):
            continue
        state = module._get_fsdp_state()
        if id(state) in seen:
            continue
        seen.add(id(state))
        modules = getattr(state, "_modules", None) or (module,)  # private: torch 2.13's tuple of the call's modules
        out.append((units.group(module_fqn.get(id(m), name) for m in modules), state))
    return out


def _local_holdings(root: nn.Module) -> tuple[dict[str, tuple[list[str], tuple[int, ...], int, int]], list[str]]:
    """This rank's view: {fqn: (units, shape, local numel, padding)} and unmanaged FQNs."""
    module_fqn = {id(m): name for name, m in module_names.named_modules(root, remove_duplicate=False)}
    held: dict[str, tuple[list[str], tuple[int, ...], int, int]] = {}
    owned_ids: set[int] = set()
    for unit_name, state in unit_states(root):
        for group in _param_groups(state):
            for fp in group.fsdp_params:
                info = fp._module_info
                prefix = module_fqn.get(id(info.module), "?")
                fqn = f"{prefix}.{info.param_name}" if prefix else info.param_name
                local = fp.sharded_param.to_local().numel()
                padding = math.prod(fp.padded_sharded_param_size) - local
                # the global shape: a DTensor on another mesh (the ep dim) has a local `_orig_size`
                owners, shape, _, _ = held.get(fqn, ([], tuple(fp.sharded_param.shape), 0, 0))
                held[fqn] = (owners + [unit_name], shape, local, padding)
                owned_ids.add(id(fp.sharded_param))
    unmanaged = [n for n, p in module_names.named_parameters(root) if id(p) not in owned_ids]
    return held, unmanaged


def fsdp2_ownership(root: nn.Module) -> OwnershipMap | None:
    """None when the module has no FSDP2 state at all (not an FSDP2 engine). Collective."""
    mine = local_holdings(root)
    world = dist.get_world_size() if dist.is_initialized() else 1
    per_rank: list = [None] * world
    if world > 1:
        dist.all_gather_object(per_rank, mine)
    else:
        per_rank = [mine]
    return ownership_from(per_rank)


def local_holdings(root: nn.Module) -> tuple[bool, dict, list[str]]:
    """This rank's part of the map (whether it has FSDP2 state, what it holds, the unmanaged
    FQNs), to be put together with every rank's by `ownership_from`."""
    has_fsdp = any(isinstance(m, FSDPModule) for m in root.modules())
    held, unmanaged = _local_holdings(root) if has_fsdp else ({}, [])
    return has_fsdp, held, unmanaged


def ownership_from(per_rank: list[tuple[bool, dict, list[str]]]) -> OwnershipMap | None:
    """The map from every rank's `local_holdings`, in rank order; None without FSDP2 state."""
    if not any(h for h, _, _ in per_rank):
        return None
    _, held, unmanaged = per_rank[0]
    helds = [other for _, other, _ in per_rank]
    names = list(held)
    for other in helds:
        names += [n for n in other if n not in names]
    params: dict[str, ParamOwnership] = {}
    for name in names:
        mine = next(other[name] for other in helds if name in other)
        params[name] = ParamOwnership(
            fqn=name,
            units=tuple(mine[0]),
            shape=mine[1],
            local_numel=tuple(other[name][2] if name in other else 0 for other in helds),
            padding=tuple(other[name][3] if name in other else 0 for other in helds),
        )
    return OwnershipMap(params=params, unmanaged=tuple(unmanaged))


# The sharded trace's meta key for `built_reshards` (verify/checks/comm.py `unit_reshards` reads it).
BUILT_RESHARDS = "reshard_after_forward"


def built_reshards(root: nn.Module) -> dict[str, bool | int]:
    """Each unit's `reshard_after_forward` as FSDP2 will run it, read from the states the engine
    built (frameworks set it per unit: torchtitan shards its blocks with True, `[norm, lm_head]`
    with False and the root with FSDP2's default). From the parameter group's
    `post_forward_mesh_info`: None is False, the group's own mesh info True, another one an int
    (its shard size); a state left to FSDP2's default (`_auto_reshard_after_forward`) that is the
    root's does not reshard (FSDP2's lazy init sets it so). Private names, feature-tested: {} where
    this release lacks them (the contracts then take the case's value)."""
    out: dict[str, bool | int] = {}
    for unit, state in unit_states(root):
        groups = _param_groups(state)
        if not groups:
            continue
        group = groups[0]
        if not hasattr(group, "post_forward_mesh_info") or not hasattr(group, "mesh_info"):
            return {}
        root_default = unit == "" and getattr(state, "_auto_reshard_after_forward", False)
        if root_default or group.post_forward_mesh_info is None:
            out[unit] = False
        elif group.post_forward_mesh_info is group.mesh_info:
            out[unit] = True
        else:
            out[unit] = int(group.post_forward_mesh_info.shard_mesh_size)
    return out
