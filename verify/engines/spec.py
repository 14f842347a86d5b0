"""ShardSpec: what an engine is told about how to shard. A stable contract for plug-in engines.

The three fields (`wrap`, `mp_policy`, `reshard_after_forward`) are what every engine applies.
The case's engine-side knobs (verify/engines/capabilities.py: offload, placements, ignored
parameters, the divide factor, prefetching, routed experts) come as FSDP2 arguments in one call,
and torch.compile as one call before sharding, so a plug-in that passes them through takes them
all and may declare so:

    def shard(model, mesh, spec):
        spec.convert(model, mesh)
        spec.compile(model)
        kwargs = spec.fully_shard_kwargs(model, mesh)
        for fqn in spec.wrap:
            fully_shard(model.get_submodule(fqn), **kwargs)
        spec.after_sharding(model)
        return model

A plan may hold a unit over several modules ("norm+output": `fully_shard([model.norm,
model.output])`, verify/units.py) only for an engine that declares the `groups` knob; such an
engine shards `spec.unit_modules(model, fqn)`, a module or the list of a group's modules.

    shard.capabilities = Capabilities(takes=ENGINE_KNOBS)

The built-in `fsdp2` engine is exactly that, after the case's tensor-parallel plan: with `tp`
the engine gets every rank's mesh, its dims named ("shard", "tp") or ("replicate", "shard",
"tp"), and `spec.parallelize(model, mesh)` applies the plan over "tp" and returns the
data-parallel mesh `fully_shard` takes (torchtitan's order; docs/tensor-parallel.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy

from fsdp_verify.case import Case
from fsdp_verify.case_specs import PrecisionSpec
from fsdp_verify.dtypes import to_torch
from fsdp_verify.units import modules_of


@dataclass(frozen=True)
class ShardSpec:
    # Module FQNs to shard, children before parents; "" is the root and comes last.
    wrap: tuple[str, ...]
    # Always set; default fields mean full precision.
    mp_policy: MixedPrecisionPolicy
    reshard_after_forward: bool | int
    # The whole Case, for engines (and mutants) that need more than the three fields above.
    case: Case | None = None
    # Under pipeline parallelism: which stage of the model this spec shards (`pipeline` hands
    # each stage to the engine with its own plan); None: the whole model.
    stage: int | None = None

    @classmethod
    def from_case(cls, case: Case) -> ShardSpec:
        return cls(
            wrap=case.wrap_plan,
            mp_policy=policy_of(case.precision),
            reshard_after_forward=case.reshard_after_forward,
            case=case,
        )

    def pipeline(self, model: nn.Module, mesh: DeviceMesh, shard_stage) -> nn.Module | None:
        """With `pp` (and this spec the whole model's): `model` cut into stages over mesh["pp"],
        this rank's stages each sharded by `shard_stage(stage, data_parallel_mesh, stage_spec)`
        (the engine itself: `stage_spec` carries the stage's units) and scheduled
        (verify/engines/pipeline_parallel.py, torchtitan's PP + FSDP); returns what the engine
        returns. Without: None, and the engine shards `model` as it does."""
        if self.case is None or self.case.pp == 1 or self.stage is not None:
            return None
        from fsdp_verify.engines.pipeline_engine import build_pipeline

        return build_pipeline(model, mesh, self, shard_stage)

    def expert_parallel(self, model: nn.Module, mesh: DeviceMesh) -> DeviceMesh:
        """With `ep`: the grouped experts distributed over mesh["ep"] with all-to-all token
        dispatch (verify/engines/expert_parallel.py, torchtitan's ExpertParallel), and the mesh
        to `fully_shard` the dense parameters over; the experts' own comes from `unit_kwargs`.
        Without: nothing applied, `mesh` itself."""
        if self.case is None or self.case.ep == 1:
            return mesh
        from fsdp_verify.engines.expert_parallel import apply_expert_parallel

        return apply_expert_parallel(model, mesh)

    @staticmethod
    def unit_modules(model: nn.Module, fqn: str) -> nn.Module | list[nn.Module]:
        """What `fully_shard` takes for unit `fqn` of the plan: its module, or the list of a
        group's modules in the plan's order (one unit over them all)."""
        modules = modules_of(model, fqn)
        return modules if len(modules) > 1 else modules[0]

    @staticmethod
    def unit_kwargs(unit: nn.Module | list[nn.Module], kwargs: dict[str, Any]) -> dict[str, Any]:
        """`fully_shard_kwargs` for one unit: the experts under expert parallelism are sharded
        over the ranks their ep dim leaves (`expert_parallel` names that mesh on them); an int
        `reshard_after_forward` that group does not divide reshards them fully (True) instead."""
        mesh = getattr(unit[0] if isinstance(unit, list) else unit, "fsdp_mesh", None)
        if mesh is None:
            return kwargs
        rsf = kwargs["reshard_after_forward"]
        if not isinstance(rsf, bool) and mesh.size(mesh.ndim - 1) % rsf:
            rsf = True
        return {**kwargs, "mesh": mesh, "reshard_after_forward": rsf}

    def parallelize(self, model: nn.Module, mesh: DeviceMesh) -> DeviceMesh:
        """The case's tensor-parallel plan applied over `mesh["tp"]` (`parallelize_module`,
        verify/engines/tensor_parallel.py), and the mesh to `fully_shard` over: the data-parallel
        dims. Without tensor parallelism: nothing applied, `mesh` itself."""
        case = self.case
        if case is None or case.tp == 1:
            return mesh
        if self.stage is not None:  # a pipeline's stage: the plan went on the whole model before the split
            return data_parallel_mesh(mesh)
        from fsdp_verify.engines.tensor_parallel import apply_plan, plan_for

        tp_mesh = mesh["tp"]
        apply_plan(model, tp_mesh, plan_for(case, model, tp_mesh))
        return data_parallel_mesh(mesh)

    def fully_shard_kwargs(self, model: nn.Module, mesh: DeviceMesh) -> dict[str, Any]:
        """`fully_shard`'s keyword arguments for every unit of the plan: the mesh, the policy,
        `reshard_after_forward`, and the case's `offload_policy`, `shard_placement_fn` and
        `ignored_params` (FSDP2's defaults where the case asks for none). Call it once, before
        the first `fully_shard`: the placements name parameters by their FQN in the whole model."""
        from fsdp_verify.engines.placement import placement_fn
        from fsdp_verify.models import is_ignored

        case = self.case
        offload = case is not None and case.offload
        names = case.ignored if case is not None else ()
        ignored = {p for n, p in model.named_parameters() if is_ignored(names, n)}
        return {
            "mesh": mesh,
            "mp_policy": self.mp_policy,
            "reshard_after_forward": self.reshard_after_forward,
            "offload_policy": CPUOffloadPolicy(pin_memory=False) if offload else OffloadPolicy(),
            "shard_placement_fn": placement_fn(
                case.shard_placement if case else "dim0", model, mesh.size(mesh.ndim - 1)
            ),
            "ignored_params": ignored or None,
        }

    def convert(self, model: nn.Module, mesh: DeviceMesh) -> None:
        """The registered dimension packages the case has on, applied to `model` first, before any
        parallelism (torchtitan's model converters: float8, verify/dims/float8/); nothing for a
        pipeline's stage (the whole model was converted before the split) or a case with none on.
        An engine that calls it declares the packages' knobs (`Capabilities(takes=("float8",))`)."""
        if self.case is not None and self.stage is None:
            from fsdp_verify.dims.registry import call

            call(self.case, "convert", model, mesh)

    def compile(self, model: nn.Module) -> None:
        """torch.compile as the case asks (`case.compile`: each unit but the root, each block, or
        the whole model), in place: `module.compile(backend=..., fullgraph=..., dynamic=False)`, parameter
        FQNs kept. Call it before the first `fully_shard`, where torchtitan compiles (after
        activation checkpointing, which the loop applied already); nothing without `compile`
        (verify/training/compile.py, docs/compile.md)."""
        from fsdp_verify.training.compile import compile_in_place

        if self.case is not None:  # a pipeline's stage: its own units, the stage its model
            compile_in_place(self.case, model, self.wrap if self.stage is not None else None)

    def after_sharding(self, model: nn.Module) -> None:
        """What the case sets on the FSDP2 modules once every unit is sharded: the divide factor
        of `grad_reduction: sum`, the explicit prefetch lists, and, with routed experts, the
        reduce-scatter of parameters without a gradient (zeros)."""
        case = self.case
        if case is None:
            return
        if case.grad_reduction == "sum":
            sum_reduction(model)
        elif case.ep > 1:
            from fsdp_verify.engines.expert_parallel import experts_divide_factor

            experts_divide_factor(model, case.world_size)
        if case.prefetch is not None:
            from fsdp_verify.engines.prefetch import set_prefetching

            set_prefetching(model, self.wrap, case.prefetch, ignored=case.ignored)
        if case.model.experts:
            # A rank whose micro-batch reaches none of an expert's samples has no gradient for
            # it, and FSDP2 would reduce-scatter fewer parameters there than on the others; zeros
            # keep every rank's reduce-scatter the same (as a MoE trainer sets it).
            model.set_reduce_scatter_unused_params(True)


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """`mesh` without its "tp" dim: ("shard",) or ("replicate", "shard")."""
    names = tuple(n for n in (mesh.mesh_dim_names or ()) if n != "tp")
    return mesh[names] if len(names) > 1 else mesh[names[0]]


def sum_reduction(model: nn.Module) -> None:
    """`grad_reduction: sum`: `set_gradient_divide_factor(1.0)` on every unit, so FSDP2 sums the
    gradients over the shard group and the replicas (the loop divides each rank's loss by the
    world size instead). With a factor of 1 torch 2.13 issues PREMUL_SUM(1.0) on fp32 and bf16
    (`_get_gradient_divide_factors`), which gloo lacks; `set_force_sum_reduction_for_comms`
    makes it SUM in both collectives and no division (`_div_if_needed` skips 1), as fp16 already
    is: the same sum. NCCL takes PREMUL_SUM, so only gloo gets the second call."""
    gloo = dist.get_backend() == "gloo"
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.set_gradient_divide_factor(1.0)
            if gloo:
                unit.set_force_sum_reduction_for_comms(True)


def policy_of(spec: PrecisionSpec) -> MixedPrecisionPolicy:
    """The Case's precision as FSDP2's MixedPrecisionPolicy."""
    return MixedPrecisionPolicy(
        param_dtype=to_torch(spec.param_dtype),
        reduce_dtype=to_torch(spec.reduce_dtype),
        output_dtype=to_torch(spec.output_dtype),
        cast_forward_inputs=spec.cast_forward_inputs,
    )
