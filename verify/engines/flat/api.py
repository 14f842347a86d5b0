"""`fully_shard`: the FSDP2-like entry point. Apply it to modules children first, the root last:

    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    shard_all(model)  # or materialize(model, init) for a meta-device model; else the first forward

Each call makes the module a shard unit and decides, right then, which parameters the unit owns:
its own, and those of submodules that no already-wrapped descendant manages. That rule is the
fix of seed 004's bug: `module.parameters(recurse=True)` on the root also returns every wrapped
layer's parameters, which then sit in two FlatParameters and the parameter sum doubles.

Flattening and sharding happen afterwards, for all units at once (`shard_all`), because a unit
only holds references to its parameters (module, attribute) until then: on the meta device there
are no values to flatten yet (see meta_init.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdp_verify.engines.flat.flat_param import Slot
from fsdp_verify.engines.flat.unit import FlatUnit

Collect = Callable[[nn.Module], Iterator[tuple[str, nn.Module, str, nn.Parameter]]]


def unit_of(module: nn.Module) -> FlatUnit | None:
    return module.__dict__.get("_flat_unit")


def unmanaged_params(module: nn.Module) -> Iterator[tuple[str, nn.Module, str, nn.Parameter]]:
    """(relative FQN, owning module, attribute, parameter) for every parameter of `module` and
    of its submodules, skipping the subtrees of modules that are units already (seed 004's fix)."""
    for attr, p in module.named_parameters(recurse=False):
        yield attr, module, attr, p
    for child_name, child in module.named_children():
        if unit_of(child) is not None:
            continue  # a wrapped descendant manages these
        for rel, owner, attr, p in unmanaged_params(child):
            yield f"{child_name}.{rel}", owner, attr, p


def fully_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy | None = None,
    reshard_after_forward: bool | int = True,
    name: str = "",
    collect: Collect = unmanaged_params,
) -> nn.Module:
    """Make `module` a shard unit on the 1-D `mesh`. `name` is its FQN in the model (for the
    ownership map and messages). `collect` picks the parameters it owns (mutants swap it).
    `reshard_after_forward`: an int (FSDP2 keeps a copy on a smaller group) counts as True: this
    engine has no smaller group, and the numbers are the same."""
    if mesh.ndim != 1:
        raise ValueError(f"mesh_shape: the flat engine shards on one mesh dimension, got {tuple(mesh.shape)}")
    slots: list[Slot] = []
    by_tensor: dict[int, Slot] = {}
    offset = 0
    for rel, owner, attr, p in collect(module):
        if id(p) in by_tensor:  # a tied parameter: one slot, several uses
            by_tensor[id(p)].uses.append((owner, attr))
            continue
        fqn = f"{name}.{rel}" if name else rel
        slot = Slot(fqn, tuple(p.shape), offset, p.requires_grad, [(owner, attr)])
        by_tensor[id(p)] = slot
        slots.append(slot)
        offset += slot.numel
    unit = FlatUnit(module, name, slots, mesh.get_group(0), mp_policy or MixedPrecisionPolicy(), reshard_after_forward)
    unit.order = sum(1 for m in module.modules() if unit_of(m) is not None)  # children were wrapped first
    module.__dict__["_flat_unit"] = unit
    return module


def units(model: nn.Module) -> list[FlatUnit]:
    """Every unit in the model, in the order they were created (children first)."""
    found = [u for m in model.modules() if (u := unit_of(m)) is not None]
    return sorted(found, key=lambda u: u.order)


def shard_all(model: nn.Module) -> nn.Module:
    """Flatten and shard every unit. Every unit's values are read first, then the units replace
    their parameters with shard views (children first): each flattens the model as built."""
    if any(p.is_meta for p in model.parameters()):
        raise ValueError("the model is on the meta device: call flat.materialize(model, init) instead")
    todo = [(unit, unit.full_values()) for unit in units(model) if unit.flat is None]
    for unit, values in todo:
        unit.shard(values)
    everyone = units(model)
    for unit in everyone:
        unit.peers = everyone  # the end of each backward reduces them all, in this order (unit.py)
    return model
