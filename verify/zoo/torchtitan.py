"""Bugs planted around torchtitan's own code (verify/frameworks/torchtitan.py): each mutant calls
torchtitan's `parallelize_llama` unchanged and changes one thing before or after it, as the zoo's
FSDP2 mutants change one thing around `fully_shard`. No torchtitan source is copied. Registered
here, beside their definitions; the catalog adds them (verify/zoo/catalog.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from fsdp_verify.engines.spec import ShardSpec
from fsdp_verify.frameworks import torchtitan as titan
from fsdp_verify.models.moe import grouped_experts_modules
from fsdp_verify.zoo.pins import CHEAP
from fsdp_verify.zoo.registry import registrar

bug = registrar(__name__)

# Its debug Llama cut to two blocks (issue 49).
_TITAN = ("torchtitan", "llama3:debugmodel", (("n_layers", 2),))


@bug(
    "torchtitan's FSDP with FSDP2's gradient division back on while the loss is normalised by the global tokens",
    "global-token normalisation added to a loop that kept FSDP's average (torchtitan's own migration)",
    ("build",),  # the knobs check: `grad_reduction: sum` declared, the divide factor not 1.0
    world_sizes=(2,),
    precisions=("fp32",),
    pins=dict(CHEAP),
    framework=_TITAN,
)
def titan_division_left_on(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """torchtitan's FSDP, then FSDP2's gradient division turned back on (the data-parallel size),
    while the loss is still normalised by the global token count: a loop that kept FSDP's average
    after moving to global-token normalisation (torchtitan's own change): every gradient 1/dp."""
    titan.parallelize(model, mesh, spec)
    dp = spec.case.dp_size
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(float(dp))
    return model


@bug(
    "torchtitan's [norm, lm_head] unit sharded over the HSDP mesh's shard dim alone: never reduced over replicas",
    "a unit over several modules given a mesh of its own (torchtitan's separate [norm, lm_head] call)",
    ("grads",),
    world_sizes=(4,),
    precisions=("fp32",),
    pins={**CHEAP, "mesh_shape": (2, 2)},
    framework=_TITAN,
)
def titan_norm_head_over_the_shard_dim(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """torchtitan's FSDP with its `[norm, lm_head]` unit handed the shard dim of the HSDP mesh
    alone (a plan that builds that unit's mesh apart from the blocks'): its gradients are never
    reduced over the replicas, which then train apart."""
    with _group_mesh(lambda m: m["fsdp"] if "dp_replicate" in (m.mesh_dim_names or ()) else m):
        return titan.parallelize(model, mesh, spec)


@bug(
    "torchtitan's FSDP with each rank's loss divided by its own valid tokens instead of the global count",
    "per-rank token normalisation in a data-parallel loop (torchtitan's loss before global-token scaling)",
    ("loss", "grads"),
    world_sizes=(2,),
    precisions=("fp32",),
    pins={**CHEAP, "data.padded": True},
    framework=_TITAN,
)
def titan_loss_normalised_per_rank(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """torchtitan's FSDP with each rank's loss divided by its own valid tokens (times the ranks)
    instead of the step's global count: right only where every rank holds as many real tokens."""
    titan.parallelize(model, mesh, spec)
    model.loss_scale = lambda microbatch_items, rank_items, global_items, dp_size: 1.0 / rank_items
    return model


@contextlib.contextmanager
def _group_mesh(choose) -> Iterator[None]:
    """While torchtitan shards, a unit over several modules (a list given to `fully_shard`) gets
    the mesh `choose` picks instead of the one torchtitan passes."""
    from torchtitan.distributed import fsdp as titan_fsdp

    original = titan_fsdp.fully_shard

    def fully_shard(module, *args, **kwargs):
        if isinstance(module, list) and "mesh" in kwargs:
            kwargs = {**kwargs, "mesh": choose(kwargs["mesh"])}
        return original(module, *args, **kwargs)

    with mock.patch.object(titan_fsdp, "fully_shard", fully_shard):
        yield


for _mutant in (titan_division_left_on, titan_norm_head_over_the_shard_dim, titan_loss_normalised_per_rank):
    _mutant.capabilities = titan.parallelize.capabilities


@bug(
    "torchtitan's tp with the global token count all-reduced over the world: each tp rank's batch counted once more",
    "a count of the step's tokens over the wrong mesh (the world, not the batch's data-parallel ranks)",
    ("loss", "grads"),
    world_sizes=(2,),
    precisions=("fp32",),
    pins={**CHEAP, "tp": 2},
    framework=_TITAN,
)
def titan_tokens_counted_per_tp_rank(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """torchtitan's tp, the step's global token count all-reduced over the whole world instead of
    the data-parallel ranks (its batch mesh): each tp rank's copy of a batch counted as another
    replica's, every gradient 1/tp."""
    titan.parallelize(model, mesh, spec)
    tp = spec.case.tp
    model.loss_scale = lambda microbatch_items, rank_items, global_items, dp_size: dp_size / (global_items * tp)
    return model


titan_tokens_counted_per_tp_rank.capabilities = titan.parallelize.capabilities


@bug(
    "torchtitan's pipeline with its schedule dividing by the micro-batches a loss already scaled to the step",
    "a schedule built with torch's default scale_grads=True beside torchtitan's global-token loss",
    ("grads",),
    world_sizes=(2,),
    precisions=("fp32",),
    pins={**CHEAP, "pp": 2, "pp_schedule": "gpipe", "microbatches": 2},
    framework=_TITAN,
)
def titan_pp_schedule_scales_grads(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """torchtitan's pipeline with its schedule told to divide the gradients by the micro-batches
    (`scale_grads=True`, torch's default) while each micro-batch's loss is already its share of
    the step's (torchtitan's global-token scaling): a schedule built outside `pipeline_llm` with
    torch's defaults, every gradient 1/M."""
    part = titan.parallelize(model, mesh, spec)
    if spec.case.pp > 1:
        part.pipeline.schedule.scale_grads = True
    return part


titan_pp_schedule_scales_grads.capabilities = titan.parallelize.capabilities


# Its MoE debug model (Qwen3's) cut to one block of eight small experts (verify/frameworks/torchtitan.py `qwen3`).
_TITAN_MOE = ("torchtitan", "qwen3:debugmodel_moe", (("n_layers", 1),))


@bug(
    "torchtitan's MoE load balancing moving each rank's expert bias by its own tokens, never summed over the ranks",
    "load balancing built with a ParallelDims that has no loss mesh (the counts' all-reduce skipped)",
    ("buffers",),
    world_sizes=(2,),
    precisions=("fp32",),
    pins={**CHEAP, "ep": 2, "data.batch_size": 4},
    framework=_TITAN_MOE,
)
def titan_expert_bias_from_local_counts(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """torchtitan's MoE under ep, its load-balancing hook (`register_moe_load_balancing_hook`,
    unchanged) built without the "loss" mesh it sums the counts over: each rank moves its
    experts' bias by its own tokens, and the ranks route by biases that part."""
    titan.parallelize(model, mesh, spec)
    model.before_optimizer_step = titan.load_balancing([model], titan.ONE_DEVICE)
    return model


@bug(
    "torchtitan's MoE trained without its load balancing: the expert bias never moves",
    "an optimizer built outside torchtitan's container, which registers the expert-bias hook",
    ("buffers",),
    world_sizes=(2,),
    precisions=("fp32",),
    pins={**CHEAP, "ep": 2, "data.batch_size": 4},
    framework=_TITAN_MOE,
)
def titan_load_balancing_dropped(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """torchtitan's MoE under ep with its optimizers' pre-step hook gone (a trainer that builds
    its own optimizer and so never calls `register_moe_load_balancing_hook`): the bias stays
    where it started while the tokens keep being counted."""
    titan.parallelize(model, mesh, spec)
    model.before_optimizer_step = None
    return model


@bug(
    "torchtitan's MoE with its token dispatch wired to the experts' FSDP mesh dim instead of the ep dim",
    "the ep and efsdp dims swapped (tokens sent to ranks that hold the same experts)",
    ("logits",),
    world_sizes=(4,),
    precisions=("fp32",),
    pins={**CHEAP, "ep": 2, "data.batch_size": 4},
    framework=_TITAN_MOE,
)
def titan_dispatch_over_efsdp(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """torchtitan's MoE under ep 2 on 4 ranks, each block's token dispatcher then wired
    (`wire_meshes`, as `RoutedExperts.parallelize` wires it) to the experts' "efsdp" dim instead
    of "ep": every token goes to a rank that holds the same experts as its own, which computes
    it with the wrong experts."""
    titan.parallelize(model, mesh, spec)
    for _, experts in grouped_experts_modules(model):
        weight = next(experts.parameters())
        efsdp = weight.device_mesh["efsdp"] if "efsdp" in (weight.device_mesh.mesh_dim_names or ()) else None
        for module in model.modules():
            dispatcher = getattr(module, "token_dispatcher", None)
            if dispatcher is not None and getattr(module, "inner_experts", None) is experts and efsdp is not None:
                dispatcher.wire_meshes(ep_mesh=efsdp)
    return model


for _mutant in (titan_expert_bias_from_local_counts, titan_load_balancing_dropped, titan_dispatch_over_efsdp):
    _mutant.capabilities = titan.parallelize.capabilities
