"""fully_shard's knobs (issue 28, items 1-4; tests/test_fsdp2_knobs.py) and its units: a knob
applied wrong (offload, Shard(1), prefetch, a unit over several modules), or the half of it the
loop owns forgotten (the replicas' all-reduce, resharding after backward, ignored parameters'
reduction, a sum reduction's division). Each is drawn with its knob on; without it, most are
the correct engine."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_verify.engines.fsdp2 import fully_shard_engine
from fsdp_verify.engines.prefetch import set_prefetching
from fsdp_verify.engines.spec import ShardSpec
from fsdp_verify.engines.view import EngineView
from fsdp_verify.units import members
from fsdp_verify.zoo.mutants._shared import _over_engine_view, _units
from fsdp_verify.zoo.pins import CHEAP, MICROBATCHES
from fsdp_verify.zoo.registry import registrar

bug = registrar(__name__)


@bug(
    "a unit over several modules sharded as one unit a module",
    "torchtitan's fully_shard([norm, lm_head]) walked module by module (issue 49)",
    ("build",),
    pins={**CHEAP, "wrap": ("layers.0+layers.1", ""), "model.widths": (8, 6, 5, 4)},
)
def group_sharded_module_by_module(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """A unit over several modules ("norm+output") sharded as one unit a module: `fully_shard`
    called on each member, the group's one all-gather and reduce-scatter become one a module
    (an engine that walks a framework's plan module by module)."""
    split = replace(spec, wrap=tuple(m for unit in spec.wrap for m in members(unit)))
    return fully_shard_engine(model, mesh, split)


@bug(
    "under CPU offload the reduced gradient is added to the CPU copy and again from the device copy",
    "issue 28: offload_policy=CPUOffloadPolicy (seed 000's configuration), an offloaded gradient stepped twice",
    ("grads",),
    world_sizes=(1, 2, 3, 4),
    pins={**CHEAP, "offload": True},
)
def offload_grad_added_twice(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Under `offload_policy=CPUOffloadPolicy`, the reduced gradient is added to the CPU copy the
    optimizer steps and again from the device copy it was offloaded from (an offload path that
    accumulates instead of moving): every offloaded gradient counts twice. Without offload it is
    the correct engine."""
    fully_shard_engine(model, mesh, spec)
    if spec.case is not None and spec.case.offload:
        for unit in _units(model):
            unit.set_all_reduce_hook(lambda t: t.mul_(2))
    return model


@bug(
    "a Shard(1) parameter's local shard holds the rank's dim-0 rows (cut on the wrong dimension)",
    "issue 28: shard_placement_fn=Shard(1), a shard padded and cut on the wrong dimension",
    ("init",),
    pins={**CHEAP, "shard_placement": "dim1"},
)
def shard1_cut_on_dim0(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Each Shard(1) parameter's local shard filled with the rank's dim-0 slice of the full
    tensor, laid out in the shard's (rows, cols / S) shape (a loader that cuts every parameter by
    rows, whatever its placement): the DTensor says Shard(1), the rows say Shard(0). Shard(0)
    parameters are untouched, so with `shard_placement=dim0` it is the correct engine."""
    full = {
        (id(owner), attr): p.detach().clone()
        for owner in model.modules()
        for attr, p in owner.named_parameters(recurse=False)
    }
    fully_shard_engine(model, mesh, spec)
    for unit in _units(model):
        for group in unit._get_fsdp_state()._fsdp_param_groups:
            for fp in group.fsdp_params:
                if fp.fsdp_placement.dim == 0:
                    continue
                source = full[(id(fp._module_info.module), fp._module_info.param_name)]
                local = fp.sharded_param._local_tensor
                rows = source.reshape(fp.mesh_info.shard_mesh_size, -1)[fp.mesh_info.shard_mesh_rank]
                with torch.no_grad():
                    local.copy_(rows.view(local.shape))
    return model


class _ReplicaSyncView(EngineView):
    """`set_requires_all_reduce` as a faulty loop calls it: `never` leaves it off on the last
    micro-batch too, else it is ignored (the all-reduce on every micro-batch)."""

    def __init__(self, module: nn.Module, never: bool):
        super().__init__(module)
        self.never = never

    def set_requires_all_reduce(self, all_reduce: bool) -> None:
        if self.never:
            self.module.set_requires_all_reduce(False)


# HSDP accumulation with the replicas' all-reduce on the last micro-batch only (issue 28).
_REPLICA_SYNC_LAST = {
    **CHEAP,
    "mesh_shape": (2, 2),
    "microbatches": MICROBATCHES,
    "sync_every_microbatch": True,
    "replica_sync_last": True,
}


@bug(
    "HSDP accumulation whose replica all-reduce, off for the earlier micro-batches, is skipped on the last too",
    "issue 28: set_requires_all_reduce(False) for accumulation, never turned back on",
    ("grads",),
    world_sizes=(4,),
    pins=dict(_REPLICA_SYNC_LAST),
)
def replica_all_reduce_skipped_on_last(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """HSDP accumulation that turns the replicas' all-reduce off for the micro-batches before the
    last and never back on (`set_requires_all_reduce(False)` outside the loop): FSDP2 then keeps
    every micro-batch's reduce-scattered sum as partial and never hands a gradient to the
    optimizer."""
    fully_shard_engine(model, mesh, spec)
    model.verify_view = lambda: _ReplicaSyncView(model, never=True)
    return model


@bug(
    "HSDP accumulation asked for, but the replicas all-reduce on every micro-batch (R - 1 too many per unit)",
    "issue 28: set_requires_all_reduce never called; the same average, more traffic",
    ("comm",),
    world_sizes=(4,),
    pins=dict(_REPLICA_SYNC_LAST),
)
def replica_all_reduce_every_microbatch(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """HSDP accumulation asked for (`replica_sync_last`) but `set_requires_all_reduce` never
    called: the replicas all-reduce on every micro-batch. The same average in another order
    (within the tolerance); R - 1 all-reduces per unit too many on the wire."""
    fully_shard_engine(model, mesh, spec)
    model.verify_view = lambda: _ReplicaSyncView(model, never=False)
    return model


class _ReshardAfterBackwardView(EngineView):
    """`set_reshard_after_backward` as a faulty loop calls it: `never` leaves it off on the last
    micro-batch too, else it is ignored (every backward reshards)."""

    def __init__(self, module: nn.Module, never: bool):
        super().__init__(module)
        self.never = never

    def set_reshard_after_backward(self, reshard: bool) -> None:
        if self.never:
            self.module.set_reshard_after_backward(False)


@bug(
    "accumulation that stops resharding after backward and never starts again: every unit unsharded"
    " after the optimizer step, stale in the next step's forward",
    "issue 28: set_reshard_after_backward(False) for accumulation, never turned back on",
    ("grads", "memory"),
    pins={**CHEAP, "microbatches": MICROBATCHES, "reshard_after_backward_last": True},
)
def unsharded_kept_after_the_last_backward(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Accumulation that turns resharding after backward off and never back on
    (`set_reshard_after_backward(False)` outside the loop): every unit is still unsharded after
    the optimizer step, a full copy per rank, and stale: the next step's forward, which gathers
    nothing, computes with the parameters before the step."""
    fully_shard_engine(model, mesh, spec)
    model.verify_view = lambda: _ReshardAfterBackwardView(model, never=True)
    return model


@bug(
    "parameters kept unsharded between micro-batches asked for, but every backward reshards and every"
    " forward all-gathers again",
    "issue 28: set_reshard_after_backward never called; the same numbers, the saved all-gathers on the wire",
    ("comm",),
    pins={**CHEAP, "microbatches": MICROBATCHES, "reshard_after_backward_last": True},
)
def reshard_after_backward_ignored(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Parameters kept unsharded between micro-batches asked for (`reshard_after_backward_last`)
    but `set_reshard_after_backward` never called: every backward reshards and every forward
    all-gathers again. The same numbers; the all-gathers the knob exists to save, on the wire."""
    fully_shard_engine(model, mesh, spec)
    model.verify_view = lambda: _ReshardAfterBackwardView(model, never=False)
    return model


class _SumLossUndividedView(EngineView):
    """A loop that sums the gradients but forgets to divide each rank's loss by the world size."""

    def sum_loss_divisor(self, world_size: int) -> int:
        return 1


@bug(
    "gradients summed over ranks (set_gradient_divide_factor(1.0)) but the loss not divided by the"
    " world size: every gradient W times the average",
    "issue 28: the legitimate use of set_gradient_divide_factor, half done",
    ("grads",),
    pins={**CHEAP, "grad_reduction": "sum"},
)
def sum_reduction_loss_not_divided(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """`grad_reduction: sum` half done: `set_gradient_divide_factor(1.0)` on every unit, but the
    loss is not divided by the world size, so every gradient is W times the average (a SUM
    reduction adopted from a trainer that divided its loss elsewhere). Correct under avg."""
    fully_shard_engine(model, mesh, spec)
    _over_engine_view(model, _SumLossUndividedView)
    return model


@bug(
    "each rank's loss divided by the world size for a SUM reduction, but the divide factor left at"
    " FSDP2's AVG: every gradient 1/W of the average",
    "issue 28: the legitimate use of set_gradient_divide_factor, the engine's half forgotten",
    # named at the build, before the gradients it would make 1/W: a knob not applied (issue 37)
    ("build",),
    pins={**CHEAP, "grad_reduction": "sum"},
)
def sum_reduction_factor_left_at_avg(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """`grad_reduction: sum` half done the other way: each rank's loss divided by the world
    size, but `set_gradient_divide_factor` never called, so FSDP2 still averages: every gradient
    is 1/W of the average. Correct under avg."""
    case = spec.case.with_(grad_reduction="avg") if spec.case is not None else None
    return fully_shard_engine(model, mesh, replace(spec, case=case))


class _IgnoredUnreducedView(EngineView):
    """A loop that keeps a module out of FSDP but forgets its gradients' all-reduce."""

    def reduce_ignored(self, names: list[str], divide: int) -> None:
        return None


@bug(
    "parameters kept out of FSDP (ignored_params) whose gradients the loop never all-reduces: each rank"
    " steps its own, the ranks drift apart",
    "issue 28: fully_shard's ignored_params, a replicated module left unsynchronised",
    ("grads",),
    precisions=("fp32",),
    pins={
        **CHEAP,
        "ignored": ("layers.1",),
        "clip_norm": None,
        "model.widths": (16, 33, 17, 8),
        "model.experts": 0,
    },
)
def ignored_grads_not_reduced(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """`fully_shard(..., ignored_params=...)` as asked, but the loop never all-reduces the
    ignored parameters' gradients: each rank steps them with its own micro-batches' gradient and
    the replicas drift apart (FSDP2 says it will not reduce them). Correct without `ignored`."""
    fully_shard_engine(model, mesh, spec)
    model.verify_view = lambda: _IgnoredUnreducedView(model)
    return model


@bug(
    "explicit prefetching k units ahead asked for, the forward lists built k + 1 ahead: the same collectives,"
    " one more unit's gathered parameters held at once in forward",
    "issue 28: set_modules_to_forward_prefetch off by one (torchtitan's recipe generalised to k)",
    ("memory",),
    # three layers each wrapped (the default plan): a list one longer reaches a unit more
    pins={**CHEAP, "prefetch": 1, "wrap": None, "model.widths": (16, 33, 17, 8)},
)
def prefetch_one_unit_too_many(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Explicit prefetching asked for k units ahead (`prefetch`), the forward lists built k + 1
    ahead (an off-by-one in a torchtitan-style recipe): the same numbers and the same
    collectives, each unit gathered once per forward, but a unit earlier than planned, so one
    more unit's all-gather output is held at once in forward than the memory plan allows."""
    k = spec.case.prefetch if spec.case is not None else None
    if k is None:
        return fully_shard_engine(model, mesh, spec)
    fully_shard_engine(model, mesh, replace(spec, case=spec.case.with_(prefetch=None)))
    set_prefetching(model, spec.wrap, k, forward_k=k + 1, ignored=spec.case.ignored)
    return model
