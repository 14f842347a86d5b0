"""Pipeline parallelism (issue 40, docs/pipeline-parallel.md): the schedule's division by the
micro-batches, a stage boundary cut off from the graph, a clip, a reduction or a tie that forgets
the other stages, targets out of step, a resume that loads another stage's blocks."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_verify.engines.fsdp2 import fully_shard_engine
from fsdp_verify.engines.spec import ShardSpec
from fsdp_verify.training.resume import Checkpointer, saved_template
from fsdp_verify.zoo.mutants._shared import _resuming, _units
from fsdp_verify.zoo.pins import PIPELINE
from fsdp_verify.zoo.registry import registrar

bug = registrar(__name__)


@bug(
    "the schedule's gradients not divided by the micro-batches while each loss is scaled for their mean",
    "`scale_grads=False` beside a loss_fn that averages (torch.distributed.pipelining; issue 40)",
    ("grads",),
    pins=dict(PIPELINE),
)
def pp_loss_not_divided_by_microbatches(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """The schedule told not to divide the gradients by the micro-batches (`scale_grads=False`)
    while each micro-batch's loss is scaled for a mean over them: every gradient M times too large.
    Where the case's schedule does not scale (`pp_scale_grads` false, torchtitan's), the opposite:
    told to divide a loss already each micro-batch's share, every gradient M times too small."""
    fully_shard_engine(model, mesh, spec)
    if spec.case.pp > 1:
        model.pipeline.schedule.scale_grads = not spec.case.pp_scale_grads
    return model


@bug(
    "each pp rank clips by its own stages' norm, never summed over the stages",
    "a clip written for FSDP alone, kept when the model was split into stages (torchtitan clips over the pp mesh; issue 50)",
    ("grad_norm",),
    pins={**PIPELINE, "clip_norm": 0.05},
)
def pp_clip_norm_of_own_stages(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Each pp rank clips by the norm of its own stages' gradients, never summed over the "pp"
    group: every stage clips by a smaller norm than the global one (a clip written for FSDP alone,
    kept when the model was split into stages)."""
    fully_shard_engine(model, mesh, spec)
    if spec.case.pp == 1:
        return model
    from fsdp_verify.engines.pipeline_engine import PipelineView

    class OwnStagesClip(PipelineView):
        def over_stages(self, norm: torch.Tensor) -> torch.Tensor:
            return norm

    model.verify_view = lambda: OwnStagesClip(model)
    return model


class _Detached(torch.autograd.Function):
    """Identity forward; no gradient back (zeros): the activation as if detached."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return torch.zeros_like(grad)


@bug(
    "every stage after the first detaches its input: no gradient reaches the earlier stages",
    "an `x.detach()` at a stage boundary (issue 40)",
    ("grads",),
    pins=dict(PIPELINE),
)
def pp_stage_boundary_detached(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Every stage after the first cuts its input off from the graph (an `x.detach()` at the
    stage boundary): no gradient reaches the earlier stages, which train on weight decay alone."""
    fully_shard_engine(model, mesh, spec)
    if spec.case.pp > 1:
        for stage in model.pipeline.stages:
            if stage.stage_index > 0:
                stage.submod.register_forward_pre_hook(lambda _m, args: tuple(_Detached.apply(a) for a in args))
    return model


@bug(
    "the tied embedding's copies on the first and last stage each keep their own gradient",
    "weight tying across pipeline stages without the gradient all-reduce between them (issue 40)",
    ("grads",),
    model_kinds=("transformer",),
    pins={**PIPELINE, "model.tie_embeddings": True},
)
def pp_tied_embedding_grads_not_summed(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """The tied embedding's copies on the first and the last stage each keep their own gradient
    (the sum between the stages forgotten): the embedding trains on its lookup's gradient alone,
    the head on its own, and the two copies drift apart."""
    fully_shard_engine(model, mesh, spec)
    if spec.case.pp > 1:
        model.pipeline.sync_tied = lambda: None
    return model


@bug(
    "the first stage reduces on every micro-batch, each reduction divided by a factor meant for one",
    "a stage that ignores the schedule's no-sync, its divide factor set for the step's one reduction (issue 40)",
    ("grads",),
    # its own divide factor: under a sum reduction (drawn beside pp since issue 50) the knobs
    # check would name `grad_reduction` first
    pins={**PIPELINE, "grad_reduction": "avg"},
)
def pp_stage_reduces_every_microbatch(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """The first stage ignores the schedule's no-sync and reduces on every micro-batch, each
    reduction divided by data-parallel size x micro-batches (a factor meant for one reduction of
    the whole step's sum): its gradients come out M times too small once the schedule divides."""
    fully_shard_engine(model, mesh, spec)
    if spec.case.pp == 1:
        return model
    factor = float(spec.case.dp_size * spec.case.microbatches)
    for stage in model.pipeline.stages:
        if stage.stage_index == 0:
            stage.submod.set_requires_gradient_sync = lambda *_a, **_k: None
            for unit in _units(stage.submod):
                unit.set_gradient_divide_factor(factor)
                unit.set_force_sum_reduction_for_comms(True)
    return model


@bug(
    "the last stage takes the targets' micro-batches in reverse order",
    "a stage's data loader out of step with the first stage's (issue 40)",
    ("grads",),
    pins=dict(PIPELINE),
)
def pp_microbatches_reversed_on_last_stage(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """The last stage takes the targets' micro-batches in reverse order: each output meets
    another micro-batch's targets (its data loader and the first stage's out of step)."""
    fully_shard_engine(model, mesh, spec)
    if spec.case.pp == 1 or not model.pipeline.last:
        return model
    schedule, m = model.pipeline.schedule, spec.case.microbatches
    step = schedule.step

    def reversed_targets(*args, target=None, **kwargs):
        if target is not None:
            target = torch.cat(list(reversed(target.tensor_split(m))))
        return step(*args, target=target, **kwargs)

    schedule.step = reversed_targets
    return model


class _StageLoadsAnotherStage(Checkpointer):
    """Loads everything, but the last stage's blocks take the first stage's saved weights (its
    optimizer state its own): a loop that saved each stage's blocks under their index within the
    stage (`layers.0` the first block of every stage) and loads each stage from the first
    stage's file. Where a block of the other stage has another shape it loads its own."""

    def load(self, path, optimizer):
        self.saved = {k: tuple(v.shape) for k, v in saved_template(path)["model"].items()}
        return super().load(path, optimizer)

    def rename(self, model_sd):
        self.original = model_sd
        pipe = getattr(self.module, "pipeline", None)
        if pipe is None or not pipe.last or pipe.first:
            return model_sd
        blocks = sorted({int(k.split(".")[1]) for k in model_sd if k.startswith("layers.")})
        shift = blocks[0] if blocks else 0

        def other(key: str) -> str:
            head, _, rest = key.partition(".")
            if head != "layers":
                return key
            index, _, tail = rest.partition(".")
            moved = f"layers.{int(index) - shift}.{tail}"
            return moved if self.saved.get(moved) == tuple(model_sd[key].shape) else key

        return {other(k): v for k, v in model_sd.items()}

    def set(self, optimizer, model_sd, optim_sd, strict=True):
        super().set(optimizer, self.original, optim_sd, strict)  # the same tensors, read in place


pp_stage_loads_another_stages_state = bug(
    "after a resume the last stage's blocks hold the first stage's saved weights",
    "each stage's blocks saved under their index within the stage and loaded from another stage's (issue 40)",
    ("resumed",),
    model_kinds=("transformer",),  # every block of one shape: the other stage's loads without complaint
    pins={**PIPELINE, "resume": True, "resume_pp": 2},
    name="pp_stage_loads_another_stages_state",
)(_resuming(_StageLoadsAnotherStage))
