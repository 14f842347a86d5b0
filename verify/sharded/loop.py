"""The sharded side of a comparison: the toolkit's training loop around an engine, on one rank.

Runs identically in a pool worker and in place under torchrun. Every rank keeps its pieces of the
records (verify/sharded/collect.py); one gather at the end puts them together, and rank 0 alone
keeps the Trace. `phase` is called before each stage so that a crash or hang can be reported by
rank and phase.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from fsdp_verify.case import Case
from fsdp_verify.dims import registry
from fsdp_verify.engines import ShardSpec, capabilities_of, resolve_engine
from fsdp_verify.engines.contracts import ENGINE_CHECKPOINTED
from fsdp_verify.engines.fsdp2_ownership import BUILT_RESHARDS, built_reshards
from fsdp_verify.engines.view import EngineView, view_of
from fsdp_verify.models import build_model, is_frozen, is_ignored
from fsdp_verify.models.custom import logits_of
from fsdp_verify.models.moe import moe_layers
from fsdp_verify.probes import PROBES
from fsdp_verify.sharded.collect import Collector
from fsdp_verify.trace import Trace
from fsdp_verify.training.checkpointing import CACHE_OFF, checkpoint_units, checkpoint_wrapped, without_kv_cache
from fsdp_verify.training.compile import fresh_compiler
from fsdp_verify.training.data import as_call, global_batch, item_count, microbatch_slices, rank_slice, take
from fsdp_verify.training.export import export_safetensors
from fsdp_verify.training.loss import global_mean_scale, microbatch_loss
from fsdp_verify.training.optim import (
    optimizer_state,
    param_groups_state,
    run_model_hook_before_step,
    schedule_state,
    step_scheduler,
)
from fsdp_verify.training.resume import (
    FRESH_PARAM_GROUPS,
    rank_fingerprints,
    restore_trainer,
    saved_step,
    trainer_state,
)
from fsdp_verify.training.rng import dropout_seed
from fsdp_verify.training.user_step import StepContext, StepRecording, load_step


@dataclass
class RankContext:
    rank: int
    world_size: int
    device: torch.device
    mesh: DeviceMesh
    phase: Callable[[str], None] = lambda _p: None
    # A directory all ranks share on one host, where the records' pieces may travel as files
    # (verify/sharded/collect.py); None: through the process group.
    spill_dir: str | None = None
    # A checkpoint and resume (verify/training/resume.py): {"save": DIR} saves after the last
    # step ({"steps": N}: the whole run's steps, which a schedule spans); {"load": DIR} starts from that checkpoint (the step after its own); {"export": DIR}
    # writes the full model as DIR/model.safetensors after the last step (verify/training/export.py).
    resume: dict | None = None


def run_sharded(case: Case, ctx: RankContext) -> Trace | None:
    trace = Trace("sharded", meta={"case": case.hash, "engine": case.engine}) if ctx.rank == 0 else None
    # One rank of each data-parallel rank records the rows and the loss, as the reference has one:
    # under pipeline parallelism the first stage's (the last stage hands it its outputs), under
    # tensor parallelism the first of its tp group (whose ranks hold the same rows and loss).
    dims = case.parallel
    rows = [dims.rank_of(stage=0, dp_rank=d, tp_rank=0) for d in range(dims.dp_size)]
    records = Collector(trace, ctx.rank, ctx.world_size, ctx.device, ctx.spill_dir, row_ranks=rows)
    probes = [P(case, ctx.rank, ctx.world_size, trace) for P in PROBES]
    if case.compile is not None:
        fresh_compiler()  # this case's graphs and counts only (verify/training/compile.py)
    ctx.phase("build model")
    model = build_model(case.model, case.seed, case.init, device=ctx.device)
    for probe in probes:
        probe.after_build(model)
    if any(getattr(probe, "stop", False) for probe in probes):
        return _stopped(trace, "the ranks built different models")  # the build check names how
    ctx.phase("shard (engine)")
    engine = resolve_engine(case.engine)
    if case.activation_checkpointing:
        turned_off = without_kv_cache(model)  # the reference's model too (reference/reference_model.py)
        if trace is not None and turned_off:
            trace.meta[CACHE_OFF] = turned_off
        if not capabilities_of(engine).checkpoints:  # else the engine applies its own policy
            checkpoint_units(model, case.wrap_plan)
    sharded = engine(model, ctx.mesh, ShardSpec.from_case(case))
    if trace is not None:  # each unit's reshard_after_forward as the engine built it (the contracts read it)
        built = built_reshards(sharded)
        if built:
            trace.meta[BUILT_RESHARDS] = built
        wrapped = checkpoint_wrapped(sharded)  # checkpointed by the engine itself (the contracts read it)
        if wrapped:
            trace.meta[ENGINE_CHECKPOINTED] = wrapped
        built_dims = registry.built(case, sharded)  # what each dimension package's engine step built
        if built_dims:
            trace.meta[registry.BUILT] = built_dims
    # Its aux loss and router bias count over the data-parallel ranks: set on the module the engine
    # returns (the flat engine builds its own from the case under meta init).
    for moe in moe_layers(sharded):
        moe.count_group = dist.group.WORLD
    view = view_of(sharded)
    params = view.parameters()
    optimizer = view.make_optimizer(case.optim, params)
    run_model_hook_before_step(sharded, optimizer)
    # The schedule spans the whole run: the run up to a save has fewer steps than the case
    # (`{"save": DIR, "steps": N}`), and LinearLR's warmup is over the case's N.
    schedule_steps = (ctx.resume or {}).get("steps", case.steps)
    scheduler = view.make_scheduler(optimizer, case.optim, schedule_steps)
    ctx.phase("probes after sharding")
    for probe in probes:
        probe.after_shard(sharded, view)
    if any(getattr(probe, "stop", False) for probe in probes):
        return _stopped(trace, "the engine did not apply a knob it declares")  # the knobs check names it
    for probe in probes:
        probe.after_optimizer(optimizer, view)

    loading = ctx.resume is not None and "load" in ctx.resume
    if not loading:  # a resumed run's state is the checkpoint's, recorded as it is loaded
        ctx.phase("step 0 record initial params")
        _record_params_and_state(records, 0, view, {}, initial=True)
    # A data-parallel rank's stream, the same on every rank of its tp group: replicated activations
    # draw the same dropout mask there (docs/tensor-parallel.md).
    seed = dropout_seed(case, case.parallel.dp_rank(ctx.rank))
    if ctx.device.type == "cpu":
        # the CPU's generator alone: `torch.manual_seed` also queues a seed for CUDA, formatting
        # a stack trace each call (0.7 ms, 1.4% of a tiny case's rank time; py-spy)
        torch.default_generator.manual_seed(seed)
    else:
        torch.manual_seed(seed)
    run_steps = _user_steps if case.step is not None else _pipeline_steps if case.pp > 1 else _toolkit_steps
    dtypes, items = run_steps(case, ctx, sharded, view, (optimizer, scheduler), params, probes, records)
    for probe in probes:
        probe.finish()
    ctx.phase("gather records")  # and what the probes kept
    per_rank = records.finish([probe.to_gather() for probe in probes])
    if per_rank is not None:  # rank 0
        for i, probe in enumerate(probes):
            probe.gathered([mine[i] for mine in per_rank])
    for probe in probes:
        # The engine's module holds the probes through its hooks, in reference cycles that live
        # until Python's cyclic collector runs; the trace must not live that long with them (a
        # medium case's 70 MB: every case grew rank 0's heap by its trace, and a pool's rank 0
        # grew to 1 GB).
        probe.trace = None
    ctx.phase("done")
    if trace is not None:
        trace.meta["dtypes"] = dtypes
        trace.meta["items"] = items  # per step, rank and micro-batch: what the loss averages over
    return trace


def _stopped(trace: Trace | None, why: str) -> Trace | None:
    """The run ends before its first step: only the build checks judge it (verify/runner.py)."""
    if trace is not None:
        trace.meta["stopped"] = why
    return trace


def _toolkit_steps(case, ctx, sharded, view, optimizers, params, probes, records):
    """The toolkit's own loop: micro-batches, the loss normalised by the global item count,
    the engine's clip, the optimizer step and the schedule's; returns (dtypes seen, items per
    rank and micro-batch)."""
    optimizer, scheduler = optimizers
    loss_scale = getattr(sharded, "loss_scale", None) or _global_mean
    scaler = view.grad_scaler(case.loss_scaling, ctx.device) if case.loss_scaling is not None else None
    stepped = [0]  # optimizer steps this rank took: a step the scaler skipped adds none
    optimizer.register_step_post_hook(lambda *_: stepped.__setitem__(0, stepped[0] + 1))
    dtypes: dict[str, str] = {}
    items: dict[str, list[list[int]]] = {}
    ignored = [n for n in params if is_ignored(case.ignored, n)]
    first, position = 1, 0  # the first step to run; global batches consumed before it
    if ctx.resume is not None and "load" in ctx.resume:
        first, position = _resume(ctx.resume["load"], case, ctx, view, (optimizer, scheduler), params, scaler, records)
    for step in range(first, case.steps + 1):
        _unfreeze_if_due(step, case, ctx, view, params)
        position += 1
        inputs, targets = global_batch(case, position)
        logits, local_loss = [], torch.zeros((), dtype=torch.float32, device=ctx.device)
        dp_rank = case.parallel.dp_rank(ctx.rank)  # the ranks of a tp group take one batch
        slices = microbatch_slices(case, dp_rank)
        counts = [[item_count(case, targets[s]) for s in microbatch_slices(case, r)] for r in range(case.dp_size)]
        items[str(step)] = counts
        for m, index in enumerate(slices):
            if not case.sync_every_microbatch:
                view.set_requires_gradient_sync(m == len(slices) - 1)
            if case.replica_sync_last:
                view.set_requires_all_reduce(m == len(slices) - 1)
            if case.reshard_after_backward_last:
                view.set_reshard_after_backward(m == len(slices) - 1)
            ctx.phase(f"step {step} forward (micro-batch {m})")
            for probe in probes:
                probe.before_forward(step, m)
            args, kwargs = as_call(take(inputs, index, ctx.device))
            with vocabulary_parallel(case):  # the cross-entropy over vocabulary shards, and its backward
                out = logits_of(case.model, sharded(*args, **kwargs))
                for probe in probes:
                    probe.after_forward(step, m, out)
                scale = loss_scale(counts[dp_rank][m], sum(counts[dp_rank]), sum(map(sum, counts)), case.dp_size)
                loss = microbatch_loss(case, out, targets[index].to(ctx.device), scale)
                # grad_reduction sum: the engine sums over the ranks, so each rank's loss is divided
                # by the world size for backward (the loss recorded is the loss itself).
                summed = loss / view.sum_loss_divisor(case.dp_size) if case.grad_reduction == "sum" else loss
                ctx.phase(f"step {step} backward (micro-batch {m})")
                (scaler.scale(summed) if scaler is not None else summed).backward()
            if ignored and m == len(slices) - 1 and ctx.world_size > 1:
                # FSDP2 leaves `ignored` parameters alone: the loop reduces their gradients itself
                view.reduce_ignored(ignored, 1 if case.grad_reduction == "sum" else ctx.world_size)
            for probe in probes:
                probe.after_backward(step, m)
            logits.append(whole(out.detach()))
            local_loss += whole(loss.detach()).float()
        dtypes["logits"] = str(out.dtype)

        ctx.phase(f"step {step} record logits and loss")
        records.rows(step, "logits", "logits", torch.cat(logits))
        records.mean(step, "loss", "loss", local_loss)

        ctx.phase(f"step {step} record gradients")
        _record_grads(records, step, view, dtypes)
        if scaler is not None:
            ctx.phase(f"step {step} unscale gradients")
            scale, before = scaler.get_scale(), stepped[0]
            view.unscale_(scaler, optimizer)
        if case.clip_norm is not None:
            ctx.phase(f"step {step} clip gradients")
            records.full(step, "grad_norm", "total_norm", view.clip_grad_norm_(case.clip_norm))
        ctx.phase(f"step {step} optimizer step")
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
            ctx.phase(f"step {step} record loss scale")  # a collective: every rank must know the skips
            if not _record_loss_scale(records, step, scale, stepped[0] == before, ctx.device):
                # Ranks that parted (one stepped, one skipped) hold optimizer state of other
                # shapes: the next gathers would mismatch. The decisions are the finding; stop.
                optimizer.zero_grad(set_to_none=True)
                break
        else:
            optimizer.step()
        step_scheduler(scheduler)
        for moe in moe_layers(sharded):  # the router biases move by the step's counts (DeepSeek-V3)
            moe.update_router_bias()
        optimizer.zero_grad(set_to_none=True)
        _after_step(case, ctx, step, view, optimizer, params, probes, records)
    if ctx.resume is not None and "export" in ctx.resume:
        ctx.phase(f"step {case.steps} export the full model")
        export_safetensors(view.module, ctx.resume["export"])
    _save(case, ctx, view, optimizer, position, scaler, scheduler)
    return dtypes, items


def _pipeline_steps(case, ctx, sharded, view, optimizers, params, probes, records):
    """The toolkit's loop under pipeline parallelism (verify/engines/pipeline_parallel.py): one
    schedule step a step over this data-parallel rank's block, every micro-batch's loss the
    schedule's (`Pipeline.loss`); the last stage hands its outputs and loss to the first, which
    records them; then the optimizer step, as `_toolkit_steps` does."""
    optimizer, scheduler = optimizers
    pipe = sharded.pipeline
    dp_rank, m_count = case.parallel.dp_rank(ctx.rank), case.microbatches
    group = pipe.stages[0].group
    last = dist.get_global_rank(group, case.pp - 1)  # the last stage of this rank's pipeline
    factor = m_count if case.pp_scale_grads else 1
    dtypes: dict[str, str] = {}
    items: dict[str, list[list[int]]] = {}
    first, position = 1, 0  # a resume (docs/resume.md): each rank loads its stages' parameters
    if ctx.resume is not None and "load" in ctx.resume:
        first, position = _resume(ctx.resume["load"], case, ctx, view, (optimizer, scheduler), params, None, records)
    for step in range(first, case.steps + 1):
        _unfreeze_if_due(step, case, ctx, view, params)  # this rank's stages' frozen parameters
        position += 1
        inputs, targets = global_batch(case, position)
        counts = [[item_count(case, targets[s]) for s in microbatch_slices(case, r)] for r in range(case.dp_size)]
        items[str(step)] = counts
        scale = _global_mean(0, 0, sum(map(sum, counts)), case.dp_size)
        # the schedule averages the micro-batches' losses (`scale_grads`): each is scaled by their
        # count (without it, as torchtitan's schedule, each is its share as it is); under
        # grad_reduction sum the stages sum over their data-parallel ranks, so each rank's is
        # divided by their count too, as without stages (the loss recorded is the loss itself)
        divisor = view.sum_loss_divisor(case.dp_size) if case.grad_reduction == "sum" else 1
        pipe.loss = lambda out, target, s=scale * factor, d=divisor: (
            microbatch_loss(case, logits_of(case.model, out), target, s) / d
        )
        block = rank_slice(case, dp_rank)
        args, _ = as_call(take(inputs, block, ctx.device))
        ctx.phase(f"step {step} pipeline schedule")
        for probe in probes:
            probe.before_forward(step, 0)
        with vocabulary_parallel(case):  # the schedule's loss over vocabulary shards, and its backward
            out = pipe.step(args[0], targets[block].to(ctx.device))
        pipe.sync_tied()  # a tied embedding's two copies: one gradient
        for probe in probes:
            probe.after_backward(step, m_count - 1)
        ctx.phase(f"step {step} record logits and loss")
        handed: list = [None, None]
        if pipe.last:
            logits = logits_of(case.model, out).detach()
            loss = torch.zeros((), dtype=torch.float32, device=ctx.device)
            with vocabulary_parallel(case):
                for part, index in zip(logits.tensor_split(m_count), microbatch_slices(case, dp_rank)):
                    loss += whole(microbatch_loss(case, part, targets[index].to(ctx.device), scale).detach()).float()
            handed = [whole(logits).cpu(), loss.cpu()]
        dist.broadcast_object_list(handed, src=last, group=group)
        dtypes["logits"] = str(handed[0].dtype)
        records.rows(step, "logits", "logits", handed[0])
        records.mean(step, "loss", "loss", handed[1])
        ctx.phase(f"step {step} record gradients")
        _record_grads(records, step, view, dtypes)
        if case.clip_norm is not None:  # over every stage (PipelineView.clip_grad_norm_)
            ctx.phase(f"step {step} clip gradients")
            records.full(step, "grad_norm", "total_norm", view.clip_grad_norm_(case.clip_norm))
        ctx.phase(f"step {step} optimizer step")
        optimizer.step()
        step_scheduler(scheduler)
        optimizer.zero_grad(set_to_none=True)
        _after_step(case, ctx, step, view, optimizer, params, probes, records)
    _save(case, ctx, view, optimizer, position, None, scheduler)
    return dtypes, items


def _save(case, ctx, view, optimizer, position, scaler, scheduler) -> None:
    """The checkpoint after the run's last step, where the run saves (`{"save": DIR}`)."""
    if ctx.resume is not None and "save" in ctx.resume:
        ctx.phase(f"step {case.steps} save checkpoint")
        trainer = trainer_state(case.steps, position, scaler, ctx.device, scheduler, case.tp, case.pp)
        view.checkpointer().save(ctx.resume["save"], optimizer, trainer)


def _resume(path, case, ctx, view, optimizers, params, scaler, records) -> tuple[int, int]:
    """Load the checkpoint at `path` into this run's sharding and record the state as loaded
    (phase "resumed", at the step it was saved after: compared exactly, a load is a copy).
    Returns the first step to run and the data position."""
    optimizer, scheduler = optimizers
    ctx.phase("read the checkpoint's step")
    if case.unfreeze_step is not None and case.unfreeze_step <= int(saved_step(path)):
        # Unfrozen before the save, so trained and stepped: trainable before the load, or the
        # optimizer's state template (`get_state_dict`) would leave out theirs.
        ctx.phase(f"unfreeze (at step {case.unfreeze_step}, before the save)")
        view.unfreeze([n for n in params if is_frozen(case.model, n)])
    # The hyperparameters the optimizer was built with, for a hint: a group that kept them was
    # not loaded (verify/hints.py).
    records.meta(FRESH_PARAM_GROUPS, {k: v.tolist() for k, v in param_groups_state(optimizer).items()})
    ctx.phase("load checkpoint")
    trainer = view.checkpointer().load(path, optimizer)
    restore_trainer(trainer, scaler, case.parallel.dp_rank(ctx.rank), scheduler)
    saved = int(trainer["step"][0])
    position = int(trainer["data_position"][0])
    ctx.phase(f"step {saved} record the loaded state")
    state = optimizer_state(optimizer, params)
    if _makes_own(view, "full_params", "param_sums", "full_optimizer_state"):
        full, opt = view.full_params(), view.full_optimizer_state(state)
    else:
        full, opt = view.parameters(), state
    records.tensors(saved, "resumed", {f"params.{n}": t for n, t in full.items()})
    records.tensors(saved, "resumed", {f"optim.{n}": t for n, t in opt.items()})
    for key, value in param_groups_state(optimizer).items():
        records.full(saved, "resumed", key, value)
    if scheduler is not None:
        for key, value in schedule_state(scheduler).items():
            records.full(saved, "resumed", key, value)
    records.full(saved, "resumed", "rng", rank_fingerprints(ctx.device))
    records.full(saved, "resumed", "data_position", torch.tensor([position], dtype=torch.int64))
    if scaler is not None:
        records.full(saved, "resumed", "loss_scale.scale", torch.tensor([float(scaler.get_scale())]))
        tracker = int(scaler._get_growth_tracker())
        records.full(saved, "resumed", "loss_scale.growth_tracker", torch.tensor([tracker], dtype=torch.int64))
    return saved + 1, position


def _user_steps(case, ctx, sharded, view, optimizers, params, probes, records):
    """A user's own step (verify/training/user_step.py) on this rank's block of the global batch
    (no schedule and no unfreezing: the Case refuses them with a user's step). Its optimizer is
    the one this loop made and hands it, so a save and a resume are this loop's, around it:
    `torch.distributed.checkpoint` of the module and that optimizer (docs/resume.md)."""
    optimizer, _ = optimizers
    step_fn = load_step(case.step)
    dtypes: dict[str, str] = {}
    items: dict[str, list[list[int]]] = {}
    first, position = 1, 0  # as in `_toolkit_steps`: one global batch per step
    if ctx.resume is not None and "load" in ctx.resume:  # the optimizer the step steps, loaded
        first, position = _resume(ctx.resume["load"], case, ctx, view, optimizers, params, None, records)
    for step in range(first, case.steps + 1):
        position += 1
        _user_step(case, ctx, (step, position), step_fn, sharded, view, optimizer, probes, records, dtypes, items)
        _after_step(case, ctx, step, view, optimizer, params, probes, records)
    _save(case, ctx, view, optimizer, position, None, None)
    return dtypes, items


def _user_step(case, ctx, at, step_fn, sharded, view, optimizer, probes, records, dtypes, items) -> None:
    """One call of the step, recorded around: logits at every forward, gradients before the clip
    or the optimizer, the clip's norm (this rank's), the loss it returns averaged over ranks.
    `at`: (the step, the data position: the global batch it takes)."""
    step, position = at
    inputs, targets = global_batch(case, position)
    block = rank_slice(case, ctx.rank)
    batch = (take(inputs, block, ctx.device), targets[block].to(ctx.device))
    items[str(step)] = [
        [item_count(case, targets[s]) for s in microbatch_slices(case, r)] for r in range(ctx.world_size)
    ]
    logits: list[torch.Tensor] = []
    forwards = [0]

    def before_forward() -> None:
        ctx.phase(f"step {step} user step: forward {forwards[0]}")
        for probe in probes:
            probe.before_forward(step, forwards[0])

    def on_forward(out) -> None:
        out = logits_of(case.model, out)
        for probe in probes:
            probe.after_forward(step, forwards[0], out)
        logits.append(out.detach())
        dtypes["logits"] = str(out.dtype)
        forwards[0] += 1
        # What runs next is the user's own code (the loss, backward): a rank that fails there
        # is named with it, not with the record phase before.
        ctx.phase(f"step {step} user step: loss and backward after forward {forwards[0] - 1}")

    def on_grads() -> None:
        ctx.phase(f"step {step} record gradients")
        for probe in probes:
            probe.after_backward(step, case.microbatches - 1)
        _record_grads(records, step, view, dtypes)
        ctx.phase(f"step {step} user step: clip and optimizer step")

    def on_norm(norm: torch.Tensor) -> None:
        full = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        records.full(step, "grad_norm", "total_norm", full.detach())

    step_ctx = StepContext(
        ctx.world_size,
        ctx.rank,
        case.microbatches,
        item_count(case, targets),
        case.sync_every_microbatch,
        ctx.device,
        _set_sync=view.set_requires_gradient_sync,
        _clip=view.clip_grad_norm_,
    )
    recording = StepRecording(sharded, optimizer, on_forward, on_grads, on_norm, before_forward)
    ctx.phase(f"step {step} user step")
    try:
        with recording.around_step():
            loss = step_fn(sharded, optimizer, batch, step_ctx)
    finally:
        recording.remove()
    ctx.phase(f"step {step} record logits and loss")
    if logits:
        records.rows(step, "logits", "logits", torch.cat(logits))
    records.mean(step, "loss", "loss", torch.as_tensor(loss).detach().float().reshape(()))


def _after_step(case, ctx, step, view, optimizer, params, probes, records) -> None:
    if any(registry.on(case)):
        ctx.phase(f"step {step} dimension packages after the optimizer step")
        registry.call(case, "after_optimizer_step", view.module)  # float8's scales (verify/dims/float8/)
    ctx.phase(f"step {step} record params and optimizer state")
    _record_params_and_state(records, step, view, optimizer_state(optimizer, params))
    ctx.phase(f"step {step} probes after the step")
    for probe in probes:
        probe.after_step(step)


def _record_loss_scale(records: Collector, step: int, scale: float, skipped: bool, device: torch.device) -> bool:
    """Every rank's loss scale for this step and whether its optimizer skipped the step, in rank
    order: decisions, compared exactly. Rank 0's alone would miss a rank that skipped (or
    stepped) against the others. Returns whether the ranks agreed on the skip (all know it)."""
    mine = torch.tensor([scale, float(skipped)], dtype=torch.float64, device=device)
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, mine)
    # Fresh tensors from lists: a column of a (1, 2) stack has stride 2 and a size-1 dimension,
    # which `contiguous()` keeps as it is, and the trace's byte packing cannot view.
    scales, skips = zip(*(p.tolist() for p in parts))
    records.full(step, "loss_scale", "scale", torch.tensor(scales, dtype=torch.float32))
    records.full(step, "loss_scale", "skipped", torch.tensor(skips, dtype=torch.int64))
    return len(set(skips)) == 1


def vocabulary_parallel(case: Case):
    """`loss_parallel()` where the case asks for loss parallelism (the head's output is sharded
    over the vocabulary and the cross-entropy must see it so, forward and backward), else nothing."""
    if not case.loss_parallel:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def whole(t: torch.Tensor) -> torch.Tensor:
    """A tensor whole: a DTensor's full value (loss parallelism's logits, sharded over the
    vocabulary, and its loss), a plain tensor as it is."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _unfreeze_if_due(step: int, case, ctx, view: EngineView, params) -> None:
    """From the case's `unfreeze_step` on, the frozen parameters this rank holds train."""
    if step == case.unfreeze_step:
        ctx.phase(f"step {step} unfreeze")
        view.unfreeze([n for n in params if is_frozen(case.model, n)])


def _global_mean(microbatch_items: int, rank_items: int, global_items: int, dp_size: int) -> float:
    """Each micro-batch's loss sum times dp_size / global items (seed 000). An engine that owns its
    loss normalisation (veRL- or slime-style trainers do) may give its module a `loss_scale` with
    this signature; the zoo's normalisation mutants do."""
    return global_mean_scale(dp_size, global_items)


def _makes_own(view: EngineView, *methods: str) -> bool:
    """Whether the engine's view makes these full tensors itself (FSDP1 and the flat engine do):
    what it gives is then recorded whole; else the DTensors are recorded shard by shard."""
    return any(getattr(type(view), m) is not getattr(EngineView, m) for m in methods)


def _record_grads(records: Collector, step: int, view: EngineView, dtypes: dict[str, str]) -> None:
    """Gradients after reduction, before clipping; parameters without a gradient are absent."""
    if _makes_own(view, "full_grads"):
        grads = view.full_grads()
    else:
        grads = {n: p.grad for n, p in view.parameters().items() if p.grad is not None}
    for g in grads.values():
        dtypes["grads"] = str(g.dtype)
    records.tensors(step, "grads", grads)


def _record_params_and_state(
    records: Collector, step: int, view: EngineView, state: dict[str, torch.Tensor], initial: bool = False
) -> None:
    """Full params, and per-param sums computed from the local shards (sum of each shard, then
    added over the shard group): a second path that sees padding leaking into shards or a
    parameter held twice; then the optimizer state."""
    phase = "init" if initial else "params"
    if _makes_own(view, "full_params", "param_sums", "full_optimizer_state"):
        sums = view.param_sums()
        records.tensors(step, phase, view.full_params())
        for name, s in sums.items():
            records.full(step, "param_sums", name, s)
        records.tensors(step, "optim_state", view.full_optimizer_state(state))
        names = list(sums)
    else:
        params = view.parameters()
        records.tensors(step, phase, params, sums="param_sums")
        records.tensors(step, "optim_state", state)
        names = list(params)
    records.total(step, "param_sums", "__total__", of=names)
