"""The pipeline an engine builds (docs/pipeline-parallel.md): this rank's stages sharded and
scheduled (`build_pipeline`), the copy of the model that holds what the rank trains, and the view
the loop records through (`PipelineView`). The case's side, the split and the mesh live in
verify/engines/pipeline_parallel.py."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_verify.engines.pipeline_parallel import (
    PP,
    data_parallel_mesh,
    drop_others,
    split,
    stage_wrap,
    stages_per_rank,
)
from fsdp_verify.engines.view import EngineView, by_mesh, norm_by_mesh
from fsdp_verify.models import is_frozen
from fsdp_verify.sharded.gather import gather_full, sum_full


@dataclass
class Pipeline:
    """This rank's part of the pipeline: its stage modules, their `PipelineStage`s, the schedule,
    and the loss the loop sets each step (`loss(output, target)` of one micro-batch)."""

    case: Any
    module: nn.Module  # the rank's copy of the model: what it trains, under the model's names
    modules: list[nn.Module]
    stages: list[Any]
    schedule: Any = None
    loss: Any = None
    first: bool = False  # holds stage 0: takes the inputs
    last: bool = False  # holds the last stage: takes the targets, gives the outputs
    # Tied embeddings across the first and the last stage: (the group of the two ranks holding a
    # copy, the module holding this rank's copy, its attribute); None: none here.
    tied: tuple | None = None

    def step(self, inputs, targets: torch.Tensor) -> torch.Tensor | None:
        """One schedule step over this rank's block of the batch; the last stage's outputs, in
        micro-batch order, where this rank holds it."""
        args = (inputs,) if self.first else ()
        kwargs: dict[str, Any] = {}
        if self.last:
            kwargs = {"target": targets, "losses": [], "return_outputs": True}
        return self.schedule.step(*args, **kwargs)

    def sync_tied(self) -> None:
        """The tied embedding's gradient summed between its copies on the first and the last
        stage (each reduced over its data-parallel ranks and divided by the schedule first), so
        both copies take the same update: the gradient of the weight they are."""
        if self.tied is not None:
            group, module, name = self.tied
            grad = getattr(module, name).grad
            if grad is not None:
                dist.all_reduce(grad._local_tensor if hasattr(grad, "_local_tensor") else grad, group=group)


def build_pipeline(model: nn.Module, mesh: DeviceMesh, spec, shard_stage) -> nn.Module:
    """Split `model`, keep this rank's stages, shard each (`shard_stage(stage, dp_mesh,
    stage_spec)`), schedule them; returns the rank's copy of the model with its `Pipeline` as
    `.pipeline` and the view the loop records through."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    case = spec.case
    pp_mesh, dp_mesh = mesh[PP], data_parallel_mesh(mesh)
    p, pp, per = pp_mesh.get_local_rank(), case.pp, stages_per_rank(case.pp_schedule)
    n_stages = pp * per
    device = next(model.parameters()).device
    if case.tp > 1:  # the tp plan on the whole model (a style is its module's): each stage keeps its own
        spec.parallelize(model, mesh)
    everything = split(case, model, n_stages)
    indices = [p + k * pp for k in range(per)]
    mine = [everything[i] for i in indices]
    drop_others(model, mine)
    stages = []
    for i, stage in zip(indices, mine):
        shard_stage(stage, dp_mesh, replace(spec, wrap=stage_wrap(spec.wrap, model, stage), stage=i))
        stages.append(PipelineStage(stage, i, n_stages, device, group=pp_mesh.get_group()))
    pipe = Pipeline(case, model, mine, stages, first=0 in indices, last=n_stages - 1 in indices)
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved1f1b": ScheduleInterleaved1F1B}
    schedule = kind[case.pp_schedule]
    pipe.schedule = schedule(
        stages if per > 1 else stages[0],
        n_microbatches=case.microbatches,
        loss_fn=lambda output, target: pipe.loss(output, target),
        scale_grads=case.pp_scale_grads,
    )
    pipe.tied = _tied_copies(case, model, dp_mesh, pipe)
    model.pipeline = pipe
    model.verify_view = lambda: PipelineView(model)
    return model


def _tied_copies(case, model: nn.Module, dp_mesh: DeviceMesh, pipe: Pipeline) -> tuple | None:
    """The Transformer's tied embedding, held by the first stage (`tok_embeddings.weight`) and the
    last (`output.weight`): the group of each data-parallel rank's two copies (every rank makes
    every group, in order), and this rank's copy, if it holds one."""
    if case.model.kind != "transformer" or not case.model.tie_embeddings:
        return None
    dp, last = case.dp_size, case.pp - 1
    dims = case.parallel
    group, _ = dist.new_subgroups_by_enumeration([[dims.rank_of(0, d), dims.rank_of(last, d)] for d in range(dp)])
    if pipe.first:
        return group, model.tok_embeddings, "weight"
    if pipe.last:
        return group, model.output, "weight"
    return None


# ---- what the loop reads --------------------------------------------------------------------------
class PipelineView(EngineView):
    """Full tensors under pipeline parallelism: each stage's gathered over its data-parallel
    ranks (`gather_full`, as without stages) and handed to rank 0 by the stage's first rank (one
    `gather_object` over every rank). Collectives: every rank calls them in the same order; the
    ranks but 0 get {}."""

    def roots(self) -> list[nn.Module]:
        """Each of the rank's stages: a root of its own (views sharing the model's blocks)."""
        return list(self.module.pipeline.modules)

    def unfreeze(self, names: list[str]) -> None:
        """The last stage's copy of a tied embedding (`output.weight`) unfrozen with the first's:
        frozen as one weight when built, it is frozen under the first one's name only, and the
        two copies' gradients are summed after every step (`sync_tied`), on both or neither."""
        case, params = self.module.pipeline.case, self.parameters()
        tied = (
            tied_head(case)
            if any(is_frozen(case.model, n) for n in ("tok_embeddings.weight", *tied_head(case)))
            else ()
        )
        super().unfreeze([*names, *(n for n in tied if n in params and n not in names)])

    def _to_rank0(self, mine: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        from fsdp_verify.models import parameter_names

        case, rank = self.module.pipeline.case, dist.get_rank()
        sent = {n: t.detach().cpu() for n, t in mine.items()} if case.parallel.coords(rank).dp_rank == 0 else {}
        got: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
        dist.gather_object(sent, got, dst=0)
        if got is None:
            return {}
        # A tied weight once, under its first name: the first stage's copy (the last's is its twin).
        aliases = tied_head(case)
        merged = {
            n: t for part in got for n, t in part.items() if not any(n == a or n.startswith(a + ".") for a in aliases)
        }
        order = {n: i for i, n in enumerate(parameter_names(case.model))}  # the model's, as the reference's
        return dict(sorted(merged.items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0])))

    def full_params(self) -> dict[str, torch.Tensor]:
        return self._to_rank0(_gathered({n: p.detach() for n, p in self.parameters().items()}))

    def param_sums(self) -> dict[str, torch.Tensor]:
        params = self.parameters()
        return self._to_rank0(dict(zip(params, sum_full([p.detach() for p in params.values()]))))

    def full_grads(self) -> dict[str, torch.Tensor]:
        return self._to_rank0(_gathered({n: p.grad for n, p in self.parameters().items() if p.grad is not None}))

    def full_optimizer_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self._to_rank0(_gathered(state))

    def ownership(self):
        """Not read across the stages' roots yet: the ownership check says n/a."""
        return None

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the global norm over every stage, as torchtitan clips under pp: this rank's
        stages' norm (FSDP2's, over the data-parallel shards), squared, summed over the "pp"
        group, and the root; each gradient scaled by it. A tied embedding counts once: the last
        stage's copy (`output.weight`) holds the same gradient as the first's after `sync_tied`,
        and is clipped without being counted again."""
        pipe = self.module.pipeline
        params = self.parameters()
        clipped = [p for p in params.values() if p.grad is not None]
        counted = [p for n, p in params.items() if p.grad is not None and n not in tied_head(pipe.case)]
        if counted:  # under tp the stages' gradients lie on two meshes: each one's norm (`norm_by_mesh`)
            norm = norm_by_mesh(by_mesh(counted)).float()
        else:
            norm = torch.zeros((), dtype=torch.float32, device=pipe.stages[0].device)
        norm = self.over_stages(norm)
        for group in by_mesh(clipped):
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
        return norm

    def over_stages(self, norm: torch.Tensor) -> torch.Tensor:
        """This rank's stages' `norm` made the norm over every stage: squared, summed over "pp"."""
        squared = norm**2
        dist.all_reduce(squared, group=self.module.pipeline.stages[0].group)
        return squared.sqrt()


def tied_head(case) -> tuple[str, ...]:
    """The last stage's copy of a tied embedding, which a norm over the stages counts once."""
    return ("output.weight",) if case.model.kind == "transformer" and case.model.tie_embeddings else ()


def _gathered(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return dict(zip(tensors, gather_full(list(tensors.values()))))
