"""The reference for a user's own training step (verify/training/user_step.py).

The step runs unchanged, once per step, on one device with the global batch (`ctx.world_size ==
1`); its model is the user's model inside `VirtualRanks`, which runs each forward's rows rank by
rank as the sharded ranks run them: with that rank's dropout generator, on that rank's own copy of
the parameters in `param_dtype` (a leaf, as FSDP2's all-gathered parameter), and at the end of
every backward reduces the ranks' gradients with the trainer's own emulation of the engine's
reduction (`average` in gloo's ring order, or a flat engine's `FlatLayout`), in `reduce_dtype`,
into the parameters' fp32 `.grad`; inside `ctx.no_sync()` each rank accumulates its own instead,
as FSDP2 does, until a synced backward reduces the sums. Every backward is seeded with W instead of
1 (`_backward_scaled_by`), so each rank's backward runs at the scale it has on a rank (a correct
step scales its loss by W / global items there). What the step does between forward and optimizer
(accumulation, clipping, the step itself) is the user's code on both sides.

`order` ("rank", "reverse"), `unit_input_node=False` and `perturb=SEED` are the calibration runs
and the floor, as for the toolkit's own loop (reference/trainer.py, reference/perturbation.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.func import functional_call

from fsdp_verify.case import Case
from fsdp_verify.compare.tolerance import unit_roundoff
from fsdp_verify.dtypes import to_torch
from fsdp_verify.engines import engine_arithmetic
from fsdp_verify.engines.arithmetic import FSDP2, Arithmetic
from fsdp_verify.models.custom import logits_of
from fsdp_verify.reference.perturbation import Perturbation
from fsdp_verify.reference.records import carried_over, record_buffers, record_params, record_resumed
from fsdp_verify.reference.reduction import FlatLayout, average, hsdp_average
from fsdp_verify.reference.reference_model import reference_model
from fsdp_verify.trace import Trace
from fsdp_verify.training.data import global_batch, item_count, microbatch_slices, take
from fsdp_verify.training.optim import make_optimizer, optimizer_state
from fsdp_verify.training.rng import dropout_states, rng_fingerprint
from fsdp_verify.training.user_step import StepContext, StepRecording, call_reference_step, load_step, split_rows


class VirtualRanks(nn.Module):
    """The user's model, each forward's rows split into `world_size` equal blocks run one rank
    after the other on that rank's own compute copy of the parameters (see the module docstring);
    at the end of every backward the ranks' gradients are reduced as the engine reduces them
    (`reduce`), or kept per rank while the step is in `ctx.no_sync()`; everything else is the
    model's own."""

    def __init__(self, module: nn.Module, case: Case, order: str, rng_states: list[torch.Tensor], reduce):
        super().__init__()
        self.module = module
        self.world = case.world_size
        self.param_dtype = to_torch(case.precision.param_dtype)
        self.reduce_dtype = to_torch(case.precision.reduce_dtype) or self.param_dtype or torch.float32
        self.order = order
        self.rng_states = rng_states
        self.reduce = reduce  # (per-rank gradients) -> None: averages them into the parameters' .grad
        self.fingerprints: dict[str, list[int]] = {}
        self.forwards = 0
        self.sync = True
        self.pending: list[list[dict[str, torch.Tensor]]] = []  # per forward, per rank: compute copies
        self.local: list[dict[str, torch.Tensor]] = [{} for _ in range(self.world)]  # no-sync accumulators
        self.queued = False

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_modules"]["module"], name)

    def set_sync(self, sync: bool) -> None:
        self.sync = sync

    def forward(self, *args, **kwargs):
        rows = _rows((args, kwargs))
        if rows % self.world:
            raise ValueError(
                f"step: a forward on {rows} rows, which do not split over world_size={self.world} ranks"
                " (split the batch with ctx.split(batch))"
            )
        blocks = list(zip(split_rows(args, self.world), split_rows(kwargs, self.world)))
        params = dict(self.module.named_parameters())
        outs: list = [None] * self.world
        copies: list[dict[str, torch.Tensor]] = [{} for _ in range(self.world)]
        m = self.forwards
        self.forwards += 1
        for r in reversed(range(self.world)) if self.order == "reverse" else range(self.world):
            self.fingerprints.setdefault(f"before_forward.{m}", [0] * self.world)[r] = rng_fingerprint(
                self.rng_states[r]
            )
            torch.set_rng_state(self.rng_states[r])
            copies[r] = {n: self._compute_copy(p) for n, p in params.items()}
            outs[r] = functional_call(self.module, copies[r], blocks[r][0], blocks[r][1])
            self.rng_states[r] = torch.get_rng_state()
            self.fingerprints.setdefault(f"after_forward.{m}", [0] * self.world)[r] = rng_fingerprint(
                self.rng_states[r]
            )
        self.pending.append(copies)
        return _cat_outputs(outs)

    def _compute_copy(self, p: torch.Tensor) -> torch.Tensor:
        """A rank's unsharded parameter in param_dtype, a leaf of its own: its gradient is this
        rank's alone (as FSDP2's all-gathered parameter), reduced at the end of the backward."""
        t = p.detach().to(self.param_dtype or p.dtype).requires_grad_(p.requires_grad)
        if t.requires_grad:
            t.register_hook(self._queue_reduction)
        return t

    def _queue_reduction(self, grad: torch.Tensor) -> torch.Tensor:
        if not self.queued:
            self.queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)
        return grad

    def _after_backward(self) -> None:
        """Each rank's gradients of this backward, added to its local accumulator (in
        reduce_dtype, as FSDP2 accumulates an unsynced gradient); reduced when the step syncs."""
        self.queued = False
        for copies in self.pending:
            for r, copy in enumerate(copies):
                for n, t in copy.items():
                    if t.grad is None:
                        continue
                    g = t.grad.to(self.reduce_dtype)
                    self.local[r][n] = self.local[r][n] + g if n in self.local[r] else g
                    t.grad = None
        self.pending = []
        if self.sync:
            rank_grads, self.local = self.local, [{} for _ in range(self.world)]
            if rank_grads[0]:
                self.reduce(rank_grads)


def train_reference_step(
    case: Case,
    order: str = "ring",
    unit_input_node: bool | None = None,
    perturb: int | None = None,
    arithmetic: Arithmetic = FSDP2,
    scale_ulp: bool = False,
) -> Trace:
    """`order`, `unit_input_node`, `perturb` and `arithmetic` as for `train_reference`: the ranks'
    gradients are averaged by the same code, in the same orders. `scale_ulp=True` seeds each
    backward with W four fp32 units of roundoff up: a calibration run. A rank's loss scale is the step's own
    arithmetic (W / N in one rounding, or W * (1 / N) in two, ...), which the reference cannot
    know: measured, fl(3 * fl(1 / N)) and fl(3 / N) differ by an ulp for some N, and in bf16 compute
    that flips the roundings of gradients near a tie (a tiny Llama's lm_head gradient at step 2,
    6.6x the floor)."""
    jolt = Perturbation(perturb, case.world_size) if perturb is not None else None
    current = {"step": 0}
    rng_states = dropout_states(case)
    model, params, ranks = _virtual_ranks(case, order, unit_input_node, arithmetic, jolt, current, rng_states)
    optimizer = make_optimizer(case.optim, params.values())
    step_fn = load_step(case.step)
    trace = Trace("reference", meta={"case": case.hash, "step": case.step, "order": order, "perturbed": perturb})
    record_params(trace, 0, params, initial=True)
    record_buffers(trace, 0, model)
    run = case
    for step in range(1, case.steps + 1):
        current["step"] = step
        _one_step(run, step, step_fn, ranks, model, params, optimizer, jolt, trace, scale_ulp)
        if step == case.resume_after:  # goes on as the resumed run does (docs/resume.md)
            run = case.after_resume()
            if jolt is not None:  # the same moves, for the new number of ranks
                moved = Perturbation(0, run.world_size)
                moved.generator, moved.moved = jolt.generator, jolt.moved
                jolt = moved
            fresh = dropout_states(run)
            rng_states = [rng_states[r] if r < len(rng_states) else fresh[r] for r in range(run.world_size)]
            on = engine_arithmetic(run.engine) if case.resume_engine else arithmetic
            old_model, old_optimizer = model, optimizer
            model, params, ranks = _virtual_ranks(run, order, unit_input_node, on, jolt, current, rng_states)
            carried_over(old_model, model)
            optimizer = make_optimizer(run.optim, params.values())
            optimizer.load_state_dict(old_optimizer.state_dict())
            record_resumed(trace, step, params, optimizer, rng_states)
    if jolt is not None:
        trace.meta["moved"] = sorted(jolt.moved)
    return trace


def _virtual_ranks(case, order, unit_input_node, arithmetic, jolt, current, rng_states):
    """The model with the engine's casts, its parameters, and the `VirtualRanks` around it whose
    backward reduces the ranks' gradients as the engine does."""
    model = reference_model(case, arithmetic, unit_input_node)
    params = dict(model.named_parameters())
    reduce_dtype = to_torch(case.precision.reduce_dtype) or to_torch(case.precision.param_dtype) or torch.float32
    layout = FlatLayout(model, case, arithmetic) if order == "ring" and arithmetic.layout == "flat" else None
    divide = arithmetic.divide_factors(reduce_dtype, case.world_size)
    # A rank's loss scale is W / N; the seed W times the one-device 1 / N is an ulp away from it
    # for some N unless W is a power of two, and in a compute dtype coarser than fp32 that flips
    # the rounding of gradients near a tie (a tiny Llama's lm_head gradient, one bf16 ulp of one
    # rank's term at step 2: 6.6x its floor before this term): no seed reproduces W / N for every
    # N (fl32(s * fl32(1/30)) skips fl32(0.1)), so the floor includes that rounding.
    compute_dtype = to_torch(case.precision.param_dtype) or torch.float32
    inexact_scale = case.world_size & (case.world_size - 1) != 0 and compute_dtype != torch.float32

    def reduce(rank_grads: list[dict[str, torch.Tensor]]) -> None:
        """ReduceOp.AVG of the ranks' gradients as the engine issues it, added to `.grad` in fp32."""
        if layout is not None:
            averaged = layout.average(rank_grads, reduce_dtype, divide)
        elif order == "ring":  # FSDP2's reduction, every rank emulated: as `_Run.average` does
            averaged = hsdp_average(rank_grads, case, reduce_dtype, divide)
        else:
            averaged = {n: average([g[n] for g in rank_grads], reduce_dtype, order, divide) for n in rank_grads[0]}
        for n, avg in averaged.items():
            if jolt is not None:
                terms, where = [g[n] for g in rank_grads], f"{current['step']}/grads"
                avg = jolt.reduction(avg, terms, where)
                if inexact_scale:
                    avg = jolt.rank_rounding(avg, terms, unit_roundoff(compute_dtype), where)
            p = params[n]
            p.grad = avg.float() if p.grad is None else p.grad + avg.float()

    return model, params, VirtualRanks(model, case, order, rng_states, reduce)


def _one_step(case, step, step_fn, ranks, model, params, optimizer, jolt, trace, scale_ulp: bool) -> None:
    """One call of the user's step on the global batch, recorded as the sharded side records it."""
    inputs, targets = global_batch(case, step)
    seed = float(case.world_size) * (1 + 4 * 2.0**-24 if scale_ulp and case.world_size > 1 else 1)
    # Micro-batch m of the reference = every rank's micro-batch m, in rank order.
    per_rank = [microbatch_slices(case, r) for r in range(case.world_size)]
    rows = torch.cat(
        [torch.arange(s.start, s.stop) for m in range(case.microbatches) for s in (p[m] for p in per_rank)]
    )
    batch = (take(inputs, rows), targets[rows])
    logits: list[torch.Tensor] = []
    ranks.fingerprints, ranks.forwards = {}, 0

    def on_grads() -> None:
        for n, p in params.items():
            if p.grad is not None:
                trace.add(step, "grads", n, p.grad)

    def on_norm(norm: torch.Tensor) -> torch.Tensor:
        if jolt is not None:
            grads = [p.grad for p in params.values() if p.grad is not None]
            norm = jolt.norm(norm, grads, f"{step}/grad_norm")
        trace.add(step, "grad_norm", "total_norm", norm)
        return norm

    def clip(max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_([p for p in params.values() if p.grad is not None], max_norm)

    ctx = StepContext(
        1,
        0,
        case.microbatches,
        item_count(case, targets),
        case.sync_every_microbatch,
        _set_sync=ranks.set_sync,
        _clip=clip,
    )
    recording = StepRecording(
        ranks, optimizer, lambda out: logits.append(logits_of(case.model, out).detach()), on_grads, on_norm
    )
    try:
        with recording.around_step(), _backward_scaled_by(seed):
            loss = call_reference_step(step_fn, case.step, ranks, optimizer, batch, ctx)
    finally:
        recording.remove()
    for name, per in ranks.fingerprints.items():
        trace.add(step, "rng", name, torch.tensor(per, dtype=torch.int64))
    if logits:
        joined = torch.cat(logits)
        if joined.shape[0] == rows.shape[0]:  # rows as the step ran them, put back in global order
            in_global_order = torch.empty_like(joined)
            in_global_order[rows] = joined
            joined = in_global_order
        trace.add(step, "logits", "logits", joined)
    trace.add(step, "loss", "loss", torch.as_tensor(loss).detach().float().reshape(()))
    record_params(trace, step, params)
    record_buffers(trace, step, model)
    for key, value in optimizer_state(optimizer, params).items():
        trace.add(step, "optim_state", key, value)


@contextlib.contextmanager
def _backward_scaled_by(factor: float) -> Iterator[None]:
    """Each rank of a correct step scales its loss by W (W / global items, the ranks' gradients
    averaged over W again); the step on one device scales by 1 (`ctx.world_size == 1`). Seeding
    every backward of the step with W instead of 1, and dividing the ranks' summed gradients by W
    (`on_grads`), runs each virtual rank's backward at the scale it has on a rank: in bf16
    compute another scale rounds every intermediate gradient differently (measured: a tiny
    Llama's lm_head gradient a bf16 ulp apart at world size 3, also when W was applied at the
    bf16 logits instead). A step that forgets the W is still caught: its ranks' gradients are
    then 1/W of this reference's."""
    if factor == 1:
        yield
        return
    original = torch.autograd.backward

    def backward(tensors, grad_tensors=None, *args, **kwargs):
        if isinstance(tensors, torch.Tensor) and grad_tensors is None and tensors.numel() == 1:
            grad_tensors = torch.full_like(tensors, factor)
        return original(tensors, grad_tensors, *args, **kwargs)

    torch.autograd.backward = backward
    try:
        yield
    finally:
        torch.autograd.backward = original


def _rows(tree) -> int:
    from torch.utils._pytree import tree_leaves

    for leaf in tree_leaves(tree):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return leaf.shape[0]
    raise ValueError("step: a forward without a batch tensor")


def _cat_outputs(outs: list):
    """The ranks' outputs joined along the batch: a tensor, a dict-like output (a
    `transformers` ModelOutput keeps its class) or a tuple of them."""
    first = outs[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(outs) if first.dim() else None  # a per-rank mean (a model's own loss) does not join
    if isinstance(first, dict):
        joined = {k: _cat_outputs([o[k] for o in outs]) for k in first if first[k] is not None}
        joined = {k: v for k, v in joined.items() if v is not None}
        return type(first)(**joined)
    if isinstance(first, (tuple, list)):
        return type(first)(_cat_outputs(list(parts)) for parts in zip(*outs))
    return first
