"""FlatUnit: the runtime of one `fully_shard`-ed module. Four hooks do all of FSDP's work:

1. pre-forward: all-gather the FlatParameter, point the module's parameters at views of it,
   cast floating inputs to `param_dtype`;
2. post-forward: cast outputs to `output_dtype`; put the shard views back as the module's
   parameters; free the unsharded buffer if `reshard_after_forward`; hook the outputs so that
3. pre-backward (a gradient reaches an output): all-gather again, into the same storage the
   saved tensors of forward point at;
4. post-backward (`full.grad` accumulated, i.e. every use of the unit's views is done): queue
   the reductions for the end of the backward. There every unit whose FlatParameter trains, in
   creation order, reduce-scatters its gradient, averaged over ranks, in `reduce_dtype`, and
   frees the buffer; with gradient sync off, the unsharded gradient is set aside and summed in
   `reduce_dtype` until a synced backward reduces it (as FSDP2 does).

Why at the end and for every unit: a unit can get no gradient on one rank and some on another (its
only trainable parameters a routed expert no sample of that rank reached, the rest frozen). It
must still join the collective, with a zero gradient (as FSDP2's
`set_reduce_scatter_unused_params`), and in the same position among the units' reduce-scatters
on every rank: reducing from the hook, in autograd's order, the ranks that skip a unit issue their
collectives in another order and hang (sweep seed 20263733, cases 3ce5265f3583, fda3f02e68cd).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from fsdp_verify.engines.flat.flat_param import FlatParameter, Slot


def _set_tensor(module: nn.Module, attr: str, tensor: torch.Tensor) -> None:
    """During compute a parameter is a plain tensor (a view), not a registered Parameter."""
    module._parameters.pop(attr, None)
    setattr(module, attr, tensor)


def _set_param(module: nn.Module, attr: str, param: nn.Parameter) -> None:
    module.__dict__.pop(attr, None)
    module._parameters[attr] = param


def _cast(obj, dtype: torch.dtype | None):
    if dtype is None:
        return obj
    return tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, obj)


class _UnitInputs(torch.autograd.Function):
    """Identity on the unit's inputs that require grad, as FSDP2's RegisterPostBackwardFunction.
    It is not needed for correctness here (the post-accumulate-grad hook runs post-backward), but
    it groups autograd's gradient sum of a tensor with several consumers (the residual stream
    feeds both `x + ...` and this unit) the way FSDP2 does, so the two engines round alike.
    The reference has its own copy on purpose: it shares no code with an engine under test."""

    @staticmethod
    def forward(ctx, *inputs: torch.Tensor):
        return inputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        return grads


def _through_unit_node(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    flat, spec = tree_flatten((args, kwargs))
    where = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not where or not torch.is_grad_enabled():
        return args, kwargs
    for i, t in zip(where, _UnitInputs.apply(*[flat[i] for i in where])):
        flat[i] = t
    return tree_unflatten(flat, spec)


class FlatUnit:
    def __init__(
        self,
        module: nn.Module,
        name: str,
        slots: list[Slot],
        group: dist.ProcessGroup,
        mp_policy: MixedPrecisionPolicy,
        reshard_after_forward: bool,
    ):
        self.module, self.name, self.slots, self.group = module, name, slots, group
        self.param_dtype = mp_policy.param_dtype or torch.float32
        self.reduce_dtype = mp_policy.reduce_dtype or self.param_dtype
        self.mp_policy, self.reshard_after_forward = mp_policy, reshard_after_forward
        self.flat: FlatParameter | None = None  # built by shard(); None if the unit owns nothing
        self.sync_gradients = True
        self._restore_queued = False
        self.peers: list[FlatUnit] = [self]  # every unit of the model, in creation order (`shard_all`)
        self._reductions_queued = False
        module.register_forward_pre_hook(self._pre_forward, with_kwargs=True)
        module.register_forward_hook(self._post_forward)

    # ---- sharding (once) -----------------------------------------------------------------------
    def full_values(self) -> list[torch.Tensor]:
        """The slots' parameters as the model holds them now (before any unit replaced them)."""
        return [getattr(*s.uses[0]) for s in self.slots]

    def shard(self, values: list[torch.Tensor]) -> None:
        """Flatten `values` into a FlatParameter, keep this rank's chunk, and register the
        chunk's per-parameter views in place of the full parameters."""
        if self.flat is not None or not self.slots:
            return
        self.flat = FlatParameter(self.slots, values, self.group, self.param_dtype)
        self._use_shard_views()
        if self.flat.full.requires_grad:
            self.flat.full.register_post_accumulate_grad_hook(self._post_backward)

    def _gather_into_compute_views(self) -> None:
        self.flat.all_gather()
        with torch.enable_grad():  # in backward too: a recomputation must save what the forward saved
            views = self.flat.compute_views()
        for slot, view in zip(self.slots, views):
            for module, attr in slot.uses:
                _set_tensor(module, attr, view)

    def _use_shard_views(self) -> None:
        for slot, view in zip(self.slots, self.flat.shard_views):
            for module, attr in slot.uses:
                _set_param(module, attr, view)

    # ---- the hooks -----------------------------------------------------------------------------
    def _pre_forward(self, _module, args, kwargs):
        if self.flat is not None:
            self._gather_into_compute_views()
        if self.mp_policy.cast_forward_inputs and self.mp_policy.param_dtype is not None:
            args, kwargs = _cast(args, self.param_dtype), _cast(kwargs, self.param_dtype)
        if self.flat is not None:
            args, kwargs = _through_unit_node(args, kwargs)
        return args, kwargs

    def _post_forward(self, _module, _args, output):
        output = _cast(output, self.mp_policy.output_dtype)
        if self.flat is None:
            return output
        if torch._C._current_graph_task_id() != -1:
            # A forward inside backward: activation checkpointing recomputing an enclosing unit.
            # This unit's own checkpointed forward is recomputed later, when its saved tensors
            # are unpacked, past the forward hooks: it must still find the full views, so they
            # stay until the backward ends (FSDP2 skips its post-forward reshard in pre-backward
            # state alike). A nested plan with checkpointing broke here (regression d700cd259782).
            self._queue_restore()
            return output
        self._use_shard_views()
        if self.reshard_after_forward:
            self.flat.free()
        if torch.is_grad_enabled():
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._pre_backward)
        return output

    def _pre_backward(self, grad: torch.Tensor) -> torch.Tensor:
        # The module holds the full views again, not only the gathered buffer: activation
        # checkpointing recomputes the unit's forward inside backward, past the forward hooks.
        # Back to the shard views when the whole backward ends, as FSDP2's final callback does (a
        # unit whose parameters get no gradient has no post-backward of its own).
        self._gather_into_compute_views()  # the gather is a no-op if it was never freed
        self._queue_restore()
        self._queue_reductions()
        return grad

    def _queue_restore(self) -> None:
        if not self._restore_queued:
            self._restore_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)

    def _after_backward(self) -> None:
        self._restore_queued = False
        self._use_shard_views()

    def _post_backward(self, _full: torch.Tensor) -> None:
        self._queue_reductions()

    def _queue_reductions(self) -> None:
        """One callback per backward, on the last unit (the root): every rank reaches a hook of
        some unit in each backward (the loss requires grad through some trainable parameter)."""
        lead = self.peers[-1]
        if not lead._reductions_queued:
            lead._reductions_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(lead._reduce_all)

    def _reduce_all(self) -> None:
        self._reductions_queued = False
        for unit in self.peers:
            unit._reduce()

    def _reduce(self) -> None:
        if self.flat is None or not self.flat.full.requires_grad:
            return
        if self.flat.full.grad is None:  # no use of a trainable view on this rank in this backward
            self.flat.full.grad = torch.zeros(
                self.flat.padded_numel, dtype=self.param_dtype, device=self.flat.shard.device
            )
        if self.sync_gradients:
            self.flat.reduce_scatter_grad(self.reduce_dtype)
        else:
            self.flat.accumulate_unsynced_grad(self.reduce_dtype)
        self.flat.free()
