"""A user's own training step, run unchanged on both sides, and what is recorded around it.

`--step pkg.module:NAME` names `NAME(model, optimizer, batch, ctx) -> loss`: forward, loss,
backward over micro-batches, clipping, `optimizer.step()`. The reference calls it once per step
with the global batch on one device (`ctx.world_size == 1`); each rank calls it with its share
under the engine. The step returns its rank's loss in the scale in which the mean over ranks is
the global loss (what a training script logs after an all-reduce AVG; a step that all-reduces its
loss itself returns the same number on every rank, whose mean is that number too).

Nothing in the step changes to be recorded (`StepRecording`): a forward hook on the root takes the
logits of every forward; `torch.nn.utils.clip_grad_norm_` / `clip_grads_with_norm_` (and
`ctx.clip_grad_norm_`) are watched for the clip's total norm, and the gradients are taken there,
before clipping, or else in the optimizer's step pre-hook; parameters and optimizer state are read
after the step returns.

Micro-batches: `ctx.split(batch)` cuts a batch into `ctx.microbatches` equal pieces along dim 0.
Rank r's share is its contiguous block of the global batch; the reference's global batch is laid
out so that its micro-batch m is every rank's micro-batch m in rank order, which lets the
reference run each rank's rows of it separately (reference/user_step.py) as the ranks do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fsdp_verify.imports import load_object
from fsdp_verify.validation import CaseError, check

Batch = tuple[Any, torch.Tensor]  # (inputs: tensor or dict of tensors, targets)


def load_step(path: str) -> Callable[..., torch.Tensor]:
    return load_object(path, "step")


def call_reference_step(step_fn: Callable[..., Any], path: str, *args: Any) -> Any:
    """The user's step on the reference: one device, no engine, so an exception there, or a step
    that returns no loss, is the step's own: bad input named `step` (exit 2), not a rank failure."""
    try:
        loss = step_fn(*args)
    except Exception as e:
        raise CaseError("step", f"a step that runs (it raised {type(e).__name__}: {e})", path) from e
    check(
        isinstance(loss, (torch.Tensor, float, int)) and not isinstance(loss, bool),
        "step",
        f"a step that returns its loss, a tensor or number (it returned {type(loss).__name__})",
        path,
    )
    return loss


def split_rows(value: Any, parts: int) -> list[Any]:
    """`value` (a tensor, or a dict / tuple / list of them, batch first) in `parts` equal pieces."""
    if isinstance(value, torch.Tensor):
        if value.shape[0] % parts:
            raise ValueError(f"ctx.split: {value.shape[0]} rows do not split into {parts} equal micro-batches")
        return list(value.chunk(parts))
    if isinstance(value, dict):
        pieces = {k: split_rows(v, parts) for k, v in value.items()}
        return [{k: pieces[k][i] for k in value} for i in range(parts)]
    if isinstance(value, (tuple, list)):
        pieces = [split_rows(v, parts) for v in value]
        return [type(value)(p[i] for p in pieces) for i in range(parts)]
    return [value] * parts


@dataclass
class StepContext:
    """What a step may legitimately need to know about where it runs."""

    world_size: int
    rank: int
    microbatches: int
    global_items: int  # real (non-padding) targets in the global batch: the loss's denominator
    sync_every_microbatch: bool = True  # the case's choice; `microbatch(m)` applies it
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    _set_sync: Callable[[bool], None] = lambda _sync: None
    _clip: Callable[[float], torch.Tensor] | None = None

    def split(self, batch: Any) -> list[Any]:
        """The batch (inputs, targets) cut into `microbatches` equal pieces along dim 0."""
        return split_rows(batch, self.microbatches)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, without reducing them (FSDP2's
        `set_requires_gradient_sync(False)`; DDP's `no_sync()`)."""
        self._set_sync(False)
        try:
            yield
        finally:
            self._set_sync(True)

    def microbatch(self, m: int) -> contextlib.AbstractContextManager:
        """Around micro-batch m's forward and backward: reduce gradients after every micro-batch or
        only after the last, as the case says."""
        last = m == self.microbatches - 1
        return contextlib.nullcontext() if self.sync_every_microbatch or last else self.no_sync()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip every gradient to a global norm the engine's way; returns that norm."""
        if self._clip is None:
            raise RuntimeError("ctx.clip_grad_norm_: this side has no clip")
        return self._clip(max_norm)


class StepRecording:
    """Hooks around one call of a user's step (see the module docstring). `on_grads()` is called
    once per step, before the gradients are clipped or stepped; `on_norm(norm)` with the clip's
    total norm, the first clip of a step only (it may return the norm to clip with instead: the
    perturbed reference's); `on_forward(output)` after every forward of the root module."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        on_forward: Callable[[Any], None],
        on_grads: Callable[[], None],
        on_norm: Callable[[torch.Tensor], torch.Tensor | None],
        before_forward: Callable[[], None] = lambda: None,
    ):
        self.on_grads, self._on_norm = on_grads, on_norm
        self.grads_taken = self.norm_taken = False
        self.handles = [
            model.register_forward_pre_hook(lambda _m, _a: before_forward()),
            model.register_forward_hook(lambda _m, _a, out: on_forward(out)),
            optimizer.register_step_pre_hook(lambda _o, _a, _k: self._grads()),
        ]

    def _grads(self) -> None:
        if not self.grads_taken:
            self.grads_taken = True
            self.on_grads()

    def on_norm(self, norm: torch.Tensor) -> torch.Tensor:
        if self.norm_taken:
            return norm
        self.norm_taken = True
        replaced = self._on_norm(norm)
        return norm if replaced is None else replaced

    @contextlib.contextmanager
    def around_step(self) -> Iterator[None]:
        """Watch the clip functions while the step runs."""
        import sys

        modules = [torch.nn.utils, sys.modules["torch.nn.utils.clip_grad"]]
        names = ("clip_grad_norm_", "clip_grads_with_norm_")
        originals = {(m, n): getattr(m, n) for m in modules for n in names if hasattr(m, n)}
        clip_with_norm = torch.nn.utils.clip_grads_with_norm_
        norm_fn = torch.nn.utils.get_total_norm
        recording = self

        def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
            params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
            recording._grads()
            grads = [p.grad for p in params if p.grad is not None]
            total = recording.on_norm(norm_fn(grads, norm_type, error_if_nonfinite, foreach))
            clip_with_norm(params, max_norm, total, foreach)
            return total

        def clip_grads_with_norm_(parameters, max_norm, total_norm, foreach=None):
            recording._grads()
            total_norm = recording.on_norm(total_norm)
            return clip_with_norm(parameters, max_norm, total_norm, foreach)

        patched = {"clip_grad_norm_": clip_grad_norm_, "clip_grads_with_norm_": clip_grads_with_norm_}
        for module, name in originals:
            setattr(module, name, patched[name])
        self.grads_taken = self.norm_taken = False
        try:
            yield
        finally:
            for (module, name), original in originals.items():
                setattr(module, name, original)
        # A step that returned without stepping the optimizer: its gradients as they are. Not
        # after a step that raised: recording then would rename the failure's phase ("clip and
        # optimizer step") and record gradients of a step that never finished.
        self._grads()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
