"""The reference for a user's own training step (verify/training/user_step.py).

The step runs unchanged, once per step, on one device with the global batch; its model is the
user's model inside `VirtualRanks`, which runs each forward's rows rank by rank as the sharded
ranks run them: with that rank's dropout generator, on parameters cast to `param_dtype` per rank
(so each rank's gradient rounds in `param_dtype` on its own, as FSDP2's per-rank backward does)
through one cast to `reduce_dtype` shared by all ranks, where autograd adds the ranks' gradients
(the reduction, in `reduce_dtype`). The user's loss is the one-device loss (normalised by the
global item count, `ctx.world_size == 1`) instead of W per-rank losses each scaled by W and
averaged: the same gradient in exact arithmetic, a few roundings apart. What the step does
between forward and optimizer (accumulation, clipping, the step itself) is the user's code on
both sides, so nothing else is emulated.

`order="reverse"` runs the ranks' rows in reverse order (autograd then adds their gradients in
another order), `unit_input_node=False` leaves FSDP2's identity node out, and `perturb=SEED` moves
each step's reduced gradients by their derived error bound 2 u(reduce_dtype) sum_r|g_r| and the
clip's norm by its bound (reference/perturbation.py), before the step clips or steps: the
calibration runs and the floor, as for the toolkit's own loop.
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
from fsdp_verify.engines.arithmetic import FSDP2, Arithmetic
from fsdp_verify.models import build_model
from fsdp_verify.models.custom import logits_of
from fsdp_verify.reference.perturbation import Perturbation
from fsdp_verify.reference.trainer import _install_precision_hooks, _record_buffers, _record_params
from fsdp_verify.trace import Trace
from fsdp_verify.training.data import global_batch, item_count, microbatch_slices, take
from fsdp_verify.training.optim import make_optimizer, optimizer_state
from fsdp_verify.training.rng import dropout_seed, rng_fingerprint
from fsdp_verify.training.user_step import StepContext, StepRecording, load_step, split_rows


class VirtualRanks(nn.Module):
    """The user's model, each forward's rows split into `world_size` equal blocks run one rank
    after the other (see the module docstring); everything else is the model's own."""

    def __init__(self, module: nn.Module, case: Case, order: str, rng_states: list[torch.Tensor]):
        super().__init__()
        self.module = module
        self.world = case.world_size
        self.param_dtype = to_torch(case.precision.param_dtype)
        self.reduce_dtype = to_torch(case.precision.reduce_dtype) or self.param_dtype
        self.order = order
        self.rng_states = rng_states
        self.fingerprints: dict[str, list[int]] = {}
        self.forwards = 0
        self.magnitude: dict[str, torch.Tensor] = {}  # sum over ranks of |g_r|, when asked for
        self.track_magnitude = False

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_modules"]["module"], name)

    def forward(self, *args, **kwargs):
        rows = _rows((args, kwargs))
        if rows % self.world:
            raise ValueError(
                f"step: a forward on {rows} rows, which do not split over world_size={self.world} ranks"
                " (split the batch with ctx.split(batch))"
            )
        blocks = list(zip(split_rows(args, self.world), split_rows(kwargs, self.world)))
        reduced = {n: p if self.reduce_dtype is None else p.to(self.reduce_dtype) for n, p in self._params().items()}
        outs: list = [None] * self.world
        m = self.forwards
        self.forwards += 1
        for r in reversed(range(self.world)) if self.order == "reverse" else range(self.world):
            self.fingerprints.setdefault(f"before_forward.{m}", [0] * self.world)[r] = rng_fingerprint(
                self.rng_states[r]
            )
            torch.set_rng_state(self.rng_states[r])
            compute = {n: self._per_rank(n, t) for n, t in reduced.items()}
            outs[r] = functional_call(self.module, compute, blocks[r][0], blocks[r][1])
            self.rng_states[r] = torch.get_rng_state()
            self.fingerprints.setdefault(f"after_forward.{m}", [0] * self.world)[r] = rng_fingerprint(
                self.rng_states[r]
            )
        return _cat_outputs(outs)

    def _params(self) -> dict[str, torch.Tensor]:
        return dict(self.module.named_parameters())

    def _per_rank(self, name: str, shared: torch.Tensor) -> torch.Tensor:
        """This rank's compute copy: cast to param_dtype (its own rounding of its own gradient),
        or a view (its own autograd node, so that its gradient can be watched on its own)."""
        if self.param_dtype is not None and self.param_dtype != shared.dtype:
            t = shared.to(self.param_dtype)
        else:
            t = shared.view_as(shared)
        if self.track_magnitude and t.requires_grad:
            t.register_hook(lambda g, n=name: self._add_magnitude(n, g))
        return t

    def _add_magnitude(self, name: str, grad: torch.Tensor) -> None:
        g = grad.detach().double().abs()
        self.magnitude[name] = self.magnitude[name] + g if name in self.magnitude else g


def train_reference_step(
    case: Case,
    order: str = "ring",
    unit_input_node: bool | None = None,
    perturb: int | None = None,
    arithmetic: Arithmetic = FSDP2,
) -> Trace:
    model = build_model(case.model, case.seed, init="eager")
    _install_precision_hooks(
        model,
        case,
        arithmetic.unit_input_node if unit_input_node is None else unit_input_node,
        arithmetic.casts_inputs_without_params,
    )
    params = dict(model.named_parameters())
    optimizer = make_optimizer(case.optim, params.values())
    rng_states = [torch.manual_seed(dropout_seed(case, r)).get_state() for r in range(case.world_size)]
    ranks = VirtualRanks(model, case, order, rng_states)
    jolt = Perturbation(perturb, case.world_size) if perturb is not None else None
    ranks.track_magnitude = jolt is not None
    step_fn = load_step(case.step)
    trace = Trace("reference", meta={"case": case.hash, "step": case.step, "order": order, "perturbed": perturb})
    _record_params(trace, 0, params, initial=True)
    _record_buffers(trace, 0, model)

    for step in range(1, case.steps + 1):
        _one_step(case, step, step_fn, ranks, model, params, optimizer, jolt, trace)
    if jolt is not None:
        trace.meta["moved"] = sorted(jolt.moved)
    return trace


def _one_step(case, step, step_fn, ranks, model, params, optimizer, jolt, trace) -> None:
    """One call of the user's step on the global batch, recorded as the sharded side records it."""
    reduce_u = unit_roundoff(to_torch(case.precision.reduce_dtype or case.precision.param_dtype) or torch.float32)
    inputs, targets = global_batch(case, step)
    # Micro-batch m of the reference = every rank's micro-batch m, in rank order.
    per_rank = [microbatch_slices(case, r) for r in range(case.world_size)]
    rows = torch.cat(
        [torch.arange(s.start, s.stop) for m in range(case.microbatches) for s in (p[m] for p in per_rank)]
    )
    batch = (take(inputs, rows), targets[rows])
    logits: list[torch.Tensor] = []
    ranks.fingerprints, ranks.forwards, ranks.magnitude = {}, 0, {}

    def on_grads() -> None:
        for n, p in params.items():
            if p.grad is None:
                continue
            if case.world_size > 1:  # the average of the ranks' W-scaled gradients (_backward_scaled_by)
                p.grad = p.grad / case.world_size
            if jolt is not None and n in ranks.magnitude:
                p.grad = jolt.move(p.grad, ranks.magnitude[n] / case.world_size, reduce_u, f"{step}/grads")
            trace.add(step, "grads", n, p.grad)

    def on_norm(norm: torch.Tensor) -> torch.Tensor:
        if jolt is not None:
            grads = [p.grad for p in params.values() if p.grad is not None]
            norm = jolt.norm(norm, grads, f"{step}/grad_norm")
        trace.add(step, "grad_norm", "total_norm", norm)
        return norm

    def clip(max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_([p for p in params.values() if p.grad is not None], max_norm)

    ctx = StepContext(1, 0, case.microbatches, item_count(case, targets), case.sync_every_microbatch, _clip=clip)
    recording = StepRecording(
        ranks, optimizer, lambda out: logits.append(logits_of(case.model, out).detach()), on_grads, on_norm
    )
    try:
        with recording.around_step(), _backward_scaled_by(case.world_size):
            loss = step_fn(ranks, optimizer, batch, ctx)
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
    _record_params(trace, step, params)
    _record_buffers(trace, step, model)
    for key, value in optimizer_state(optimizer, params).items():
        trace.add(step, "optim_state", key, value)


@contextlib.contextmanager
def _backward_scaled_by(factor: int) -> Iterator[None]:
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
