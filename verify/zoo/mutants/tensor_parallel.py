"""Tensor parallelism (issue 39): the case's tp plan mutated (applied where the built-in engine
applies the case's, so these run under pp too), the mesh's dims confused, a hand-written parallel
layer or loss missing its reduction or mask, and the resumes beside tp."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
from hypothesis import strategies as st
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from fsdp_verify.engines.fsdp2 import fully_shard_engine
from fsdp_verify.engines.spec import ShardSpec
from fsdp_verify.training.resume import Checkpointer
from fsdp_verify.zoo.mutants._shared import _local, _resuming
from fsdp_verify.zoo.pins import CHEAP, PIPELINE, RESUME
from fsdp_verify.zoo.registry import registrar

bug = registrar(__name__)

# A tp degree of 2 (world sizes 2 and 4: meshes (1, 2) and (2, 2)).
_TP = {**CHEAP, "tp": 2}
_TP_WORLDS = (2, 4)


@dataclass(frozen=True)
class _MutatedPlanSpec(ShardSpec):
    """The case's spec with its tensor-parallel plan replaced by `plan` (a mutation of it): the
    built-in engine applies it where it applies the case's (on the whole model, before a
    pipeline's split), so the mutants below run under pp too."""

    plan: dict | None = None

    def parallelize(self, model: nn.Module, mesh: DeviceMesh) -> DeviceMesh:
        from fsdp_verify.engines.spec import data_parallel_mesh
        from fsdp_verify.engines.tensor_parallel import apply_plan

        if self.stage is None:
            apply_plan(model, mesh["tp"], self.plan)
        return data_parallel_mesh(mesh)


def _parallel_then_shard(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec, plan: dict) -> nn.Module:
    """The fsdp2 engine with `plan` (a mutation of the case's) applied over "tp" first."""
    fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(ShardSpec)}
    return fully_shard_engine(model, mesh, _MutatedPlanSpec(**fields, plan=plan))


def _plan(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> dict:
    from fsdp_verify.engines.tensor_parallel import plan_for

    return plan_for(spec.case, model, mesh["tp"])


@bug(
    "under sequence parallelism a norm's weight gradient is each tp rank's partial sum, never summed over tp",
    "issue 39: Megatron's `sequence_parallel` parameter attribute forgotten (a hand-written SP norm)",
    ("grads",),
    world_sizes=_TP_WORLDS,
    model_kinds=("transformer",),
    pins={**_TP, "sequence_parallel": True, "clip_norm": None},  # norms off the tp mesh: no clip
)
def tp_norm_grad_not_reduced(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Sequence parallelism written by hand: the norms run on each rank's sequence shard with
    their weights as plain tensors (the plan's SequenceParallel left out), so nothing marks their
    gradients partial and nothing sums them over tp: each tp rank keeps the gradient of its own
    shard (Megatron's `sequence_parallel` attribute forgotten)."""
    from torch.distributed.tensor.parallel import SequenceParallel

    plan = {k: v for k, v in _plan(model, mesh, spec).items() if not isinstance(v, SequenceParallel)}
    return _parallel_then_shard(model, mesh, spec, plan)


@bug(
    "a row-parallel linear's partial output used as it is, never all-reduced over tp",
    "issue 39: the reduction of a RowwiseParallel output hook forgotten",
    ("logits",),
    world_sizes=_TP_WORLDS,
    model_kinds=("mlp", "transformer"),
    pins={**_TP, "sequence_parallel": False},
)
def rowwise_output_not_all_reduced(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """A row-parallel linear whose partial output goes on as it is: each rank's share of the sum,
    never all-reduced (the reduction in the output hook forgotten)."""
    from torch.distributed.tensor.parallel import RowwiseParallel

    class _Unreduced(RowwiseParallel):
        @staticmethod
        def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
            return outputs.to_local()  # Partial: this rank's share only

    plan = {
        k: _Unreduced(input_layouts=v.input_layouts[0]) if type(v) is RowwiseParallel and _linear(model, k) else v
        for k, v in _plan(model, mesh, spec).items()
    }
    return _parallel_then_shard(model, mesh, spec, plan)


def _linear(model: nn.Module, fqn: str) -> bool:
    return isinstance(model.get_submodule(fqn), nn.Linear)


class _AllReduceGradInParamDtype(torch.autograd.Function):
    """Identity; backward: the gradient all-reduced over `group` in its own dtype."""

    @staticmethod
    def forward(ctx, weight, group):
        ctx.group = group
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _Grouped(torch.autograd.Function):
    """Identity both ways, one autograd node: the module's own uses of its input add up first."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


@bug(
    "the norms' partial gradients summed over tp in bf16 while reduce_dtype is fp32",
    "issue 39, pytorch/pytorch#190626 (FSDP2's own, torch 2.13; here by hand)",
    ("grads", "comm"),  # the contract sees the all-reduce's dtype at step 0
    world_sizes=_TP_WORLDS,
    precisions=("bf16",),
    model_kinds=("transformer",),
    pins={**_TP, "sequence_parallel": True, "precision.reduce_dtype": "fp32", "clip_norm": None},
)
def tp_grad_all_reduce_in_bf16(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Sequence parallelism by hand that does sum the norms' partial gradients over tp, in the
    gradient's dtype (param_dtype, bf16) while reduce_dtype is fp32 (Megatron's sequence-parallel
    gradient all-reduce in the model's dtype): what pytorch/pytorch#190626 is in FSDP2 itself."""
    from torch.distributed.tensor.parallel import SequenceParallel

    from fsdp_verify.models.transformer import RMSNorm

    plan = _plan(model, mesh, spec)
    group = mesh["tp"].get_group()
    for fqn, style in plan.items():
        norm = model.get_submodule(fqn)
        if isinstance(style, SequenceParallel) and isinstance(norm, RMSNorm):

            def forward(x, norm=norm):
                x = _Grouped.apply(x)  # as DTensor.from_local groups the input's gradient sum
                weight = _AllReduceGradInParamDtype.apply(norm.weight, group)
                normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + norm.eps)
                return (normed * weight.float()).to(weight.dtype)

            norm.forward = forward
    plan = {k: v for k, v in plan.items() if not isinstance(v, SequenceParallel)}
    return _parallel_then_shard(model, mesh, spec, plan)


@bug(
    "the mesh's dims swapped: the plan over the data-parallel dim, fully_shard over tp",
    "issue 39: a mesh built as (dp, tp) read as (tp, dp)",
    ("build", "comm"),  # the contract sees each collective's group on the wrong mesh dim
    world_sizes=_TP_WORLDS,
    model_kinds=("mlp", "transformer"),
    pins=dict(_TP),
)
def fsdp_over_tp_dim(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """The mesh's dims taken the wrong way round: the plan applied over the data-parallel dim and
    `fully_shard` over "tp" (an `init_device_mesh(("dp", "tp"))` read as ("tp", "dp")), so
    ranks with different batches compute one layer's shards between them."""
    from fsdp_verify.engines.tensor_parallel import apply_plan, plan_for

    shard = mesh["shard"]
    apply_plan(model, shard, plan_for(spec.case, model, shard))
    kwargs = spec.fully_shard_kwargs(model, mesh["tp"])
    for fqn in spec.wrap:
        fully_shard(spec.unit_modules(model, fqn), **kwargs)
    spec.after_sharding(model)
    return model


@bug(
    "the world mesh's data-parallel and tp dims swapped: a tp group spans ranks of different batches",
    "issue 50: a hand-built DeviceMesh whose degrees are listed in another order than its names",
    ("logits", "grads"),
    world_sizes=(4,),
    model_kinds=("mlp", "transformer"),
    pins={**_TP, "mesh_shape": None},
)
def dp_and_tp_dims_swapped(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """The world mesh built with its data-parallel and tp dims swapped (the degrees listed in
    another order than the names, as a hand-built `DeviceMesh(arange(W).view(...))` does): a tp
    group is ranks of different data-parallel ranks, which compute one layer's shards on
    different batches; under pp the stages stay whole. Correct where the shard dim is 1."""
    names = mesh.mesh_dim_names
    s, t = names.index("shard"), names.index("tp")
    swapped = DeviceMesh(mesh.device_type, mesh.mesh.transpose(s, t).contiguous(), mesh_dim_names=names)
    return fully_shard_engine(model, swapped, spec)


@bug(
    "a column-parallel linear's bias left whole: every tp rank adds the bias's first chunk",
    "issue 39: a bias not split with its weight (a hand-written ColwiseParallel)",
    ("init",),
    world_sizes=_TP_WORLDS,
    pins=dict(_TP),
)
def colwise_bias_replicated(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """A column-parallel linear's bias left whole (replicated) while its weight is split: every
    rank adds the bias's first chunk to its slice of the output, the shard rank 0 would hold."""
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel

    class _BiasHead(ColwiseParallel):
        def _partition_linear_fn(self, name, module, device_mesh):
            module.register_parameter("weight", nn.Parameter(distribute_tensor(module.weight, device_mesh, [Shard(0)])))
            if module.bias is not None:
                head = module.bias.detach()[: module.bias.shape[0] // device_mesh.size()].clone()
                module.register_parameter("bias", nn.Parameter(DTensor.from_local(head, device_mesh, [Shard(0)])))

    plan = {
        k: _BiasHead(output_layouts=v.output_layouts[0], use_local_output=v.use_local_output)
        if type(v) is ColwiseParallel and _linear(model, k)
        else v
        for k, v in _plan(model, mesh, spec).items()
    }
    return _parallel_then_shard(model, mesh, spec, plan)


# The loss-parallel mutant: its model's next cross-entropy under `loss_parallel()` takes the
# log-softmax of each rank's vocabulary shard alone. torch's handler is patched once in a process
# that runs it and acts only on the first log-softmax after such a model's forward (`_armed`).
_armed = [False]


def _install_local_log_softmax() -> None:
    from torch.distributed.tensor.parallel import loss as tp_loss

    aten = torch.ops.aten
    handlers = tp_loss.customized_loss_ops
    correct = handlers[aten._log_softmax.default]
    if getattr(correct, "mutant", False):
        return

    def handler(op_call, args, kwargs):
        if not _armed[0]:
            return correct(op_call, args, kwargs)
        _armed[0] = False
        x = args[0]
        local = torch.log_softmax(x._local_tensor, args[1])  # no max or sum over the ranks
        return type(x)(local, x._spec, requires_grad=local.requires_grad)

    handler.mutant = True
    handlers[aten._log_softmax.default] = handler


@bug(
    "loss parallelism's log-softmax over each rank's vocabulary shard alone (no max or sum over tp)",
    "issue 39: a vocab-parallel cross-entropy missing its all-reduces",
    ("loss",),
    world_sizes=_TP_WORLDS,
    model_kinds=("transformer",),
    pins={**_TP, "loss_parallel": True},
)
def loss_parallel_without_vocab_reduction(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Loss parallelism without its reductions over the vocabulary: each rank normalises its
    shard of the logits by its own max and sum of exponentials (a home-grown vocab-parallel
    cross-entropy missing its all-reduces), so every probability is over a shard of the vocabulary."""
    _install_local_log_softmax()
    model.register_forward_pre_hook(lambda *_: _armed.__setitem__(0, True))
    return fully_shard_engine(model, mesh, spec)


@bug(
    "each rank's generator seeded by its global rank: the tp ranks draw different masks for a replicated activation",
    "issue 39: `seed + rank` where `seed + dp_rank` was meant",
    ("rng", "logits"),
    world_sizes=_TP_WORLDS,
    model_kinds=("transformer",),
    pins={**_TP, "sequence_parallel": False, "model.dropout": 0.1},
)
def dropout_seeded_per_rank(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Each rank's generator seeded by its global rank (`seed + rank`, not `seed + dp_rank`) at the
    first forward: the tp ranks draw different dropout masks for an activation they all hold."""
    seeded = [False]
    rank = dist.get_rank()

    def reseed(*_):
        if not seeded[0]:
            seeded[0] = True
            torch.manual_seed(spec.case.seed * 7919 + 1000003 * (rank + 1))

    fully_shard_engine(model, mesh, spec)
    model.register_forward_pre_hook(reseed)
    return model


@bug(
    "a vocabulary-sharded embedding clamps tokens outside a rank's rows instead of masking them",
    "issue 39: a hand-written vocab-parallel embedding without its mask (`_MaskPartial`)",
    ("logits",),
    world_sizes=_TP_WORLDS,
    model_kinds=("transformer",),
    pins=dict(_TP),
)
def embedding_tokens_not_masked(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """A vocabulary-sharded embedding (RowwiseParallel) written by hand that clamps a token
    outside its rows onto its first or last row instead of masking it out: every rank adds a row
    for every token, and the partial outputs' sum counts tokens several times."""
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ParallelStyle, RowwiseParallel

    class _Clamped(ParallelStyle):
        def __init__(self, style):
            self.output_layouts, self.use_local_output = style.output_layouts, style.use_local_output

        def _apply(self, module, device_mesh):
            module.register_parameter("weight", nn.Parameter(distribute_tensor(module.weight, device_mesh, [Shard(0)])))
            rows, lo = (
                module.num_embeddings // device_mesh.size(),
                device_mesh.get_local_rank() * (module.num_embeddings // device_mesh.size()),
            )

            def forward(tokens):
                local = torch.nn.functional.embedding((tokens - lo).clamp(0, rows - 1), module.weight.to_local())
                out = DTensor.from_local(local, device_mesh, [Partial()]).redistribute(placements=self.output_layouts)
                return out.to_local() if self.use_local_output else out

            module.forward = forward
            return module

    plan = {
        k: _Clamped(v) if isinstance(v, RowwiseParallel) and isinstance(model.get_submodule(k), nn.Embedding) else v
        for k, v in _plan(model, mesh, spec).items()
    }
    return _parallel_then_shard(model, mesh, spec, plan)


@bug(
    "under pp, the tp plan applied to the first stage only: the later stages' weights whole on every tp rank",
    "issue 50: torchtitan's 3-D parallelism, a parallelize call on `model_parts[0]` instead of each part",
    ("build",),
    world_sizes=(4,),
    model_kinds=("transformer",),
    pins={**PIPELINE, "tp": 2},
)
def tp_plan_on_first_stage_only(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Under pp, the tp plan applied to the first stage's modules only (a parallelize function
    called on `model_parts[0]` where each part needed it): the later stages' weights stay whole
    on every tp rank, computing the same as their tp group (the same numbers, none of the
    memory tp exists to save). Without pp it is the correct engine."""
    from fsdp_verify.engines.pipeline_parallel import split, stages_per_rank

    case, plan = spec.case, _plan(model, mesh, spec)
    if case.pp > 1:
        first = {id(p) for p in split(case, model, case.pp * stages_per_rank(case.pp_schedule))[0].parameters()}
        plan = {k: v for k, v in plan.items() if all(id(p) in first for p in model.get_submodule(k).parameters())}
    return _parallel_then_shard(model, mesh, spec, plan)


# ---- a resume beside tp (docs/resume.md), its degree drawn among 1 and 2 on either side ----------
class _TpShardsOnTheWrongRank(Checkpointer):
    """Loads everything, but one tensor-parallel parameter's tp shards land on the wrong tp ranks
    (rank t holds what rank t + 1 should): a loader that maps the checkpoint's shards to ranks by
    its own position in the tp group, where DCP's reshard reads them by their global offsets (a
    resume that copies `to_local()` pieces by rank index, right only where the tp layout and rank
    order never change). Only the parameter moves; its optimizer state stays where it belongs."""

    def after_load(self, optimizer, trainer):
        for _, p in self.module.named_parameters():
            mesh = getattr(p, "device_mesh", None)
            if mesh is None or "tp" not in (mesh.mesh_dim_names or ()):
                continue
            tp = mesh.mesh_dim_names.index("tp")
            if not p.placements[tp].is_shard() or mesh.size(tp) == 1:
                continue
            local = _local(p)
            pieces = [torch.empty_like(local) for _ in range(mesh.size(tp))]
            dist.all_gather(pieces, local.detach().contiguous(), group=mesh.get_group("tp"))
            with torch.no_grad():
                local.copy_(pieces[(mesh.get_local_rank("tp") + 1) % len(pieces)])
            break
        return trainer


tp_shards_on_the_wrong_rank_on_resume = bug(
    "one tensor-parallel parameter's tp shards loaded onto the wrong tp ranks (rank t holds rank t + 1's)",
    "issue 39: a loader that maps shards to ranks by position in the tp group, not by DCP's global offsets",
    ("resumed",),
    world_sizes=_TP_WORLDS,
    pins={**RESUME, "tp": st.sampled_from((1, 2))},
    name="tp_shards_on_the_wrong_rank_on_resume",
)(_resuming(_TpShardsOnTheWrongRank))


class _RngByGlobalRank(Checkpointer):
    """Loads everything, and each rank takes back the generator of its own global rank, as a
    loop without tensor parallelism does: right while the tp degree stays, wrong across a change
    of it (from tp 2 to 1, rank 1 is data-parallel rank 1 but takes the stream of rank 1 of the
    saving run, data-parallel rank 0's): its dropout masks repeat another rank's."""

    def after_load(self, optimizer, trainer):
        rank = dist.get_rank()
        if rank < trainer["rng"].shape[0]:
            torch.set_rng_state(trainer["rng"][rank].clone())
        return {k: v for k, v in trainer.items() if k != "rng"}  # restored here, not by the loop


rng_by_global_rank_on_resume = bug(
    "each rank takes back its own global rank's generator across a change of the tp degree",
    "issue 39: a resume written for data parallelism alone (rank r's stream is rank r's)",
    ("resumed",),
    world_sizes=_TP_WORLDS,
    model_kinds=("transformer",),
    pins={**RESUME, "tp": st.sampled_from((1, 2)), "model.dropout": 0.1},
    name="rng_by_global_rank_on_resume",
)(_resuming(_RngByGlobalRank))
