"""The reference's pipeline parallelism: what the schedule and the stages change in the
arithmetic, kept out of the FSDP emulation (reference/trainer.py calls in here at three points;
docs/pipeline-parallel.md). The reference trains the unsplit model on the same micro-batches.

- The schedule's loss: each micro-batch's loss is its sum over items times dp x micro-batches /
  the step's items (`backward_loss`), and the schedule divides the reduced gradients by the
  number of micro-batches once all have run (`scale_grads`, `after_reduction`): the same mean,
  rounded the schedule's way. The loss recorded is the plain one. A schedule without
  `scale_grads` (the case's `pp_scale_grads` false: torchtitan's) backpropagates each
  micro-batch's share of the step's loss as it is, and divides nothing.
- The stages accumulate every micro-batch's gradients unreduced and reduce once after the last
  (the case's `sync_every_microbatch` is false, as Case requires): the reference's no-sync path.
- Each stage is sharded on its own: its parameters that no unit of the plan holds belong to the
  stage's root, one reduce-scatter buffer per stage, not one for the model (`average`).
- Each stage is a root of its own: FSDP2 casts its input to `param_dtype` and its output to
  `output_dtype` (a residual stream a unit left in fp32 is cast back to bf16 where a stage
  begins), and passes its input through the post-backward node when the stage's root holds
  parameters. The reference runs its model's forward as the stages in order, each with those
  hooks (`staged_forward`), the same modules and units as the ranks.
- The Transformer's tied embedding is two copies, the first stage's (`tok_embeddings.weight`)
  and the last's (`output.weight`): each gets its own gradient, reduced over its stage's ranks
  and divided by the schedule, then the two are summed (`untie`, `after_reduction`).
"""

from __future__ import annotations

import torch
from torch import nn

from fsdp_verify.units import modules_of


def backward_loss(case, loss_of, loss_factor: float, loss: torch.Tensor) -> torch.Tensor:
    """The loss a rank's micro-batch backpropagates: the schedule's (see the module docstring);
    `loss_of(factor)` is the micro-batch's loss scaled by `factor` (its tp ranks' under tp)."""
    if case.pp == 1 or not case.pp_scale_grads:
        return loss
    return loss_of(loss_factor * case.microbatches)


_STAGES: dict[str, dict[str, int]] = {}


TIED_HEAD, TIED = "output.weight", "tok_embeddings.weight"


def untied(case) -> bool:
    """Whether the case's tied embedding is two copies on two stages."""
    return case.pp > 1 and case.model.kind == "transformer" and case.model.tie_embeddings


def untie(case, compute: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The compute copies with the last stage's copy of a tied embedding a leaf of its own (the
    forward then runs with `tie_weights=False`)."""
    if not untied(case):
        return compute
    first = compute[TIED]
    return {**compute, TIED_HEAD: first.detach().clone().requires_grad_(first.requires_grad)}


def staged_forward(model: nn.Module, case) -> list[tuple[nn.Module, bool]]:
    """`model`'s forward made its stages' in order (the case's split of this very model: the
    stages share its modules, so a `functional_call` on it reaches them); returns each stage and
    whether its root holds parameters of its own (no unit of the plan holds them)."""
    from fsdp_verify.engines.pipeline_parallel import split, stages_per_rank

    stages = split(case, model, case.pp * stages_per_rank(case.pp_schedule))

    def forward(*args, **kwargs):
        x = stages[0](*args, **kwargs)
        for stage in stages[1:]:
            x = stage(x)
        return x

    model.forward = forward
    plan = case.wrap_plan
    units = [m for u in plan if u for m in modules_of(model, u)]  # a group's members, each
    out = []
    for stage in stages:
        in_units = {id(p) for u in units for p in u.parameters()}
        out.append((stage, any(id(p) not in in_units for p in stage.parameters())))
    return out


def stage_of(case) -> dict[str, int]:
    """Each parameter's stage, by name: the case's split (the built-in one, or `pp_split`) of a
    model built on the meta device, as every rank splits its own."""
    if case.hash not in _STAGES:
        from fsdp_verify.engines.pipeline_parallel import split, stages_per_rank
        from fsdp_verify.models import _construct

        with torch.device("meta"):
            model = _construct(case.model)
        stages = split(case, model, case.pp * stages_per_rank(case.pp_schedule))
        if case.pp_split is None:  # the views name their parameters as the model does, a tied copy too
            _STAGES[case.hash] = {n: s for s, stage in enumerate(stages) for n, _ in stage.named_parameters()}
        else:
            names = {id(p): n for n, p in model.named_parameters()}
            _STAGES[case.hash] = {names[id(p)]: s for s, stage in enumerate(stages) for p in stage.parameters()}
    return _STAGES[case.hash]


def stages_norm(case, named: list[tuple[str, torch.Tensor]], norm_of) -> torch.Tensor:
    """A clip's norm as the pipeline clips (verify/engines/pipeline_engine.py,
    `PipelineView.clip_grad_norm_`, torchtitan's way): each pp rank's norm of its stages'
    gradients (`norm_of` those (name, parameter) pairs, in the model's order: FSDP2's arithmetic
    over the shards), squared, summed as gloo sums one element over the pp group, and the root.
    A tied embedding counts once (the reference holds it once; the last stage's copy is left
    out of its rank's norm)."""
    from fsdp_verify.engines.arithmetic import gloo_scalar_sum

    stages = stage_of(case)
    per_rank = []
    for r in range(case.pp):
        mine = [(n, p) for n, p in named if stages[n] % case.pp == r and not (untied(case) and n == TIED_HEAD)]
        per_rank.append(norm_of(mine).float() if mine else torch.zeros((), dtype=torch.float32))
    return gloo_scalar_sum([n**2 for n in per_rank]).sqrt()


def average(rank_grads, case, reduce_dtype, divide, hsdp_average) -> dict[str, torch.Tensor]:
    """FSDP2's reduction, stage by stage: each stage's units and its own root."""
    stages = stage_of(case)
    out: dict[str, torch.Tensor] = {}
    for s in sorted(set(stages.values())):
        mine = [{n: g for n, g in grads.items() if stages[n] == s} for grads in rank_grads]
        out.update(hsdp_average(mine, case, reduce_dtype, divide))
    return dict(sorted(out.items(), key=lambda kv: list(rank_grads[0]).index(kv[0])))


def after_reduction(case, master_grads: dict[str, torch.Tensor]) -> None:
    """The schedule's `scale_grads`: every reduced gradient divided by the micro-batches; then a
    tied embedding's two copies summed (an all-reduce of two: a + b either way)."""
    if case.pp > 1 and case.pp_scale_grads and case.microbatches != 1:
        for g in master_grads.values():
            g.div_(case.microbatches)
    if untied(case) and TIED_HEAD in master_grads:
        master_grads[TIED] = master_grads[TIED] + master_grads.pop(TIED_HEAD)
