"""Bugs of the engines that shard FlatParameters, not FSDP2's: the bundled flat engine's (seed 004;
tests/test_engine_flat.py) and FSDP1's hybrid and NO_SHARD strategies (verify/engines/fsdp1.py's
mesh table). Each declares that engine's capabilities and contracts, not FSDP2's."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_verify.engines.capabilities import Capabilities
from fsdp_verify.engines.contracts import Contracts
from fsdp_verify.engines.fsdp1 import fsdp1_engine, placement, wrap_fsdp1
from fsdp_verify.engines.spec import ShardSpec
from fsdp_verify.zoo.pins import CHEAP
from fsdp_verify.zoo.registry import registrar

bug = registrar(__name__)


_FLAT_CONTRACTS = Contracts(comm=False, memory=False, why="the flat engine's FlatParameters: not FSDP2's model")
# As FSDP2 for meshes (what they were drawn with before), but no fully_shard knobs: the flat engine
# ignores them.
_FLAT_CAPABILITIES = Capabilities(takes=("experts",), module_takes=("unfreeze_step",))


# ---- the bundled flat engine's bugs (seed 004; tests/test_engine_flat.py) -------------------------
def _every_param_recursively(module: nn.Module):
    """`module.parameters(recurse=True)`, as (relative FQN, owner, attribute, parameter)."""
    for prefix, owner in module.named_modules(remove_duplicate=False):
        for attr, p in owner.named_parameters(recurse=False):
            yield (f"{prefix}.{attr}" if prefix else attr), owner, attr, p


@bug(
    "the root's FlatParameter collects parameters(recurse=True): wrapped children's params held twice",
    "seed 004, finding 4 (the parameter sum doubled after wrapping)",
    ("ownership", "param_sums"),
    world_sizes=(1, 2, 3, 4),
    pins=dict(CHEAP),
)
def flat_nested_double_ownership(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Seed 004's bug in the bundled flat engine: every unit flattens `parameters(recurse=True)`,
    so the root flattens each already wrapped layer's parameters a second time. They sit in two
    FlatParameters; the parameter sum after wrapping doubles."""
    from fsdp_verify.engines.flat.engine import flat_engine

    return flat_engine(model, mesh, spec, collect=_every_param_recursively)


flat_nested_double_ownership.contracts = _FLAT_CONTRACTS
flat_nested_double_ownership.capabilities = _FLAT_CAPABILITIES


@bug(
    "meta-device build that consumes random numbers before initialisation (RNG not restored)",
    "seed 004, finding 3",
    ("init",),
    world_sizes=(1, 2, 3, 4),
    pins={**CHEAP, "init": "meta"},
)
def flat_meta_init_consumes_rng(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Seed 004 finding 3 in the flat engine's meta-device path: seeds the global generator, builds
    a throwaway eager copy to read shapes (its layers' default init draws from that generator),
    then builds on meta and initialises from the global generator without having saved and
    restored its state: every initial value comes from a later stretch of the random stream."""
    from fsdp_verify.engines.flat import materialize
    from fsdp_verify.engines.flat.engine import with_view, wrap_per_plan
    from fsdp_verify.models import _construct

    device = next(model.parameters()).device
    torch.manual_seed(spec.case.seed)
    _construct(spec.case.model)  # the bug: draws from the stream the init below relies on
    with torch.device("meta"):
        model = _construct(spec.case.model)
    wrap_per_plan(model, mesh, spec)
    return with_view(materialize(model, lambda m: m.init_weights(torch.default_generator), device))


flat_meta_init_consumes_rng.contracts = _FLAT_CONTRACTS
flat_meta_init_consumes_rng.capabilities = _FLAT_CAPABILITIES


# ---- FSDP1's hybrid and NO_SHARD strategies (verify/engines/fsdp1.py's mesh table) ----------------
# The mesh is the bug's precondition. FSDP1 has no output_dtype; no-sync is left on so that FSDP1's
# one gap the reference does not model (no-sync bf16 accumulation, `fsdp1_modelled`) cannot be the
# catch.
_FSDP1 = {"precision.output_dtype": None, "sync_every_microbatch": True}


def _fsdp1_mutant(fn):  # a decorator
    """An FSDP1 mutant is emulated and held to the contracts as FSDP1 is: caught for its bug,
    not for arithmetic the reference would model otherwise."""
    fn.arithmetic = fsdp1_engine.arithmetic
    fn.contracts = fsdp1_engine.contracts
    fn.capabilities = fsdp1_engine.capabilities  # no fully_shard knobs (offload, placements)
    return fn


@bug(
    "FSDP1 on a (replicate, shard) mesh as FULL_SHARD over the shard group: each replica group"
    " averages and steps on its own gradients",
    "HSDP set up by passing the intra-node group alone (FSDP1 HYBRID_SHARD's process_group tuple)",
    ("grads",),
    world_sizes=(4,),
    pins={**CHEAP, **_FSDP1, "mesh_shape": (2, 2)},
)
@_fsdp1_mutant
def fsdp1_hybrid_replicas_not_reduced(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """A (replicate, shard) mesh run as FULL_SHARD over the shard group alone (the intra-node
    group passed as `process_group`, HYBRID_SHARD forgotten): each replica reduce-scatters and
    averages its own ranks' gradients and never all-reduces with the others."""
    shard_only = placement(mesh[mesh.mesh_dim_names[-1]], spec.reshard_after_forward)
    return wrap_fsdp1(model, mesh, spec, shard_only)


@bug(
    "FSDP1 HYBRID_SHARD dividing the gradient by the shard group's size, not the data-parallel world's",
    "FSDP1 HSDP's divide factors before the replicate group's size was multiplied in",
    ("grads",),
    world_sizes=(4,),
    pins={**CHEAP, **_FSDP1, "mesh_shape": (2, 2)},
)
@_fsdp1_mutant
def fsdp1_hybrid_divides_by_shard_group(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """HYBRID_SHARD whose gradient divide factors come from the shard group's size, not the
    whole data-parallel world's (FSDP1 before `_init_process_group_state` multiplied in the
    replicate group's size): the all-reduced sum over the replicas is R times the average."""
    return _fsdp1_divided_by(fsdp1_engine(model, mesh, spec), mesh.size(mesh.ndim - 1))


@bug(
    "FSDP1 HYBRID_SHARD on a (W, 1) mesh: NO_SHARD over the shard group of one, never all-reduced"
    " over the replicas (each rank's own gradient / W)",
    "torch 2.13's own behaviour (tests/upstream/test_fsdp1_hybrid_shard_group_of_one.py)",
    ("grads",),
    world_sizes=(2,),
    pins={**CHEAP, **_FSDP1, "mesh_shape": (2, 1)},
)
@_fsdp1_mutant
def fsdp1_no_shard_not_all_reduced(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """HYBRID_SHARD given a (W, 1) mesh, as FSDP1 itself runs it (torch 2.13): a shard group of
    one switches it to NO_SHARD *over that group*, so the all-reduce over the replicas never
    happens; each rank steps on its own gradient divided by W
    (tests/upstream/test_fsdp1_hybrid_shard_group_of_one.py)."""
    from torch.distributed.fsdp import ShardingStrategy

    rsf = spec.reshard_after_forward is not False
    strategy = ShardingStrategy.HYBRID_SHARD if rsf else ShardingStrategy._HYBRID_SHARD_ZERO2
    return wrap_fsdp1(model, mesh, spec, dict(device_mesh=mesh, sharding_strategy=strategy))


@bug(
    "FSDP1 NO_SHARD dividing the all-reduced sum by one rank fewer than it adds",
    "a world size taken without the rank itself (DDP/FSDP migration reports)",
    ("grads",),
    world_sizes=(2,),
    pins={**CHEAP, **_FSDP1, "mesh_shape": (2, 1)},
)
@_fsdp1_mutant
def fsdp1_no_shard_divides_by_wrong_world(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """NO_SHARD whose all-reduced sum is divided by one rank fewer than it adds (a world size
    taken without the rank itself, or a hard-coded node size): gradients W / (W - 1) too large."""
    return _fsdp1_divided_by(fsdp1_engine(model, mesh, spec), max(mesh.size() - 1, 1))


def _fsdp1_divided_by(model: nn.Module, world: int) -> nn.Module:
    """Every FSDP1 unit's pre- and post-divide factors set as FSDP1 sets them for `world` ranks."""
    from torch.distributed.algorithms._comm_hooks.default_hooks import DefaultState
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    for unit in FSDP.fsdp_modules(model):
        unit._gradient_predivide_factor = DefaultState._get_gradient_predivide_factor(world)
        unit._gradient_postdivide_factor = world / unit._gradient_predivide_factor
    return model
