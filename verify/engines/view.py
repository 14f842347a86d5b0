"""EngineView: what the training loop needs from a sharded model beyond forward and backward.

FSDP2-style engines, whose parameters are DTensors, need nothing more: `DTensorView` reads full
tensors from the shards. An engine whose parameters are not DTensors (FSDP1's FlatParameter, a
home-grown engine) gives the module it returns a method `verify_view(self) -> EngineView`; the
loop then asks that view instead. All methods with full tensors are collectives: every rank calls
them in the same order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from fsdp_verify import module_names
from fsdp_verify.case_specs import LossScaleSpec, OptimSpec
from fsdp_verify.engines.ownership import OwnershipMap
from fsdp_verify.sharded.gather import gather_full, sum_full
from fsdp_verify.training.optim import make_optimizer, make_scheduler


class EngineView:
    """The default view, for DTensor parameters (and plain replicated ones)."""

    def __init__(self, module: nn.Module):
        self.module = module

    def parameters(self) -> dict[str, torch.Tensor]:
        """The tensors the optimizer steps, by their original FQN (tied weights once)."""
        return dict(module_names.named_parameters(self.module))

    def full_params(self) -> dict[str, torch.Tensor]:
        params = self.parameters()
        return dict(zip(params, gather_full([p.detach() for p in params.values()])))

    def param_sums(self) -> dict[str, torch.Tensor]:
        """float64 sum of each parameter from the local shards, reduced over the shard group."""
        params = self.parameters()
        return dict(zip(params, sum_full([p.detach() for p in params.values()])))

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Gradients after reduction, before clipping; parameters without a gradient are absent."""
        grads = {n: p.grad for n, p in self.parameters().items() if p.grad is not None}
        return dict(zip(grads, gather_full(list(grads.values()))))

    def full_optimizer_state(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return dict(zip(state, gather_full(list(state.values()))))

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip by the global norm; returns the full total norm. Gradients on several meshes
        (expert parallelism's experts on ("efsdp", "ep"), the dense ones on ("shard",)), whose
        norms one `clip_grad_norm_` cannot stack, are clipped as torchtitan clips them
        (`_clip_grad_norm_with_ep`): each mesh's total norm whole, the total the root of their
        squares' sum, each group scaled by it."""
        with_grad = [p for p in self.parameters().values() if p.grad is not None]
        groups = by_mesh(with_grad)
        if len(groups) < 2:
            norm = torch.nn.utils.clip_grad_norm_(with_grad, max_norm)
            return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        total = norm_by_mesh(groups)
        for params in groups:
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    def grad_scaler(self, spec: LossScaleSpec, device: torch.device):
        """The dynamic loss scaler for `spec`: `torch.amp.GradScaler`, which is all FSDP2 needs in
        torch 2.13. Its unscale kernel on DTensor gradients goes through DTensor's
        `found_inf_reduce_handler` (torch/distributed/tensor/_dispatch.py): each rank checks its
        local shards, then the found-inf flag is all-reduced (MAX) over the gradients' mesh, so
        every rank skips a step when any shard overflowed. `ShardedGradScaler` (written for
        FSDP1) also works on them and gives the same decisions, all-reducing the flag a second
        time (tests/test_loss_scaling.py runs both). A scaler that checks the local shards
        without that all-reduce is the zoo's `inf_check_not_all_reduced`."""
        return torch.amp.GradScaler(device.type, **spec.scaler_kwargs())

    def unscale_(self, scaler, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the scale and decide the skip, before clipping: a clip of
        scaled gradients clips by a norm `scale` times too large."""
        scaler.unscale_(optimizer)

    # ---- what the loop trains with (docs/optimizers-and-schedules.md) ----
    def make_optimizer(self, spec: OptimSpec, params: dict[str, torch.Tensor]) -> torch.optim.Optimizer:
        """The case's optimizer over every parameter the loop steps (frozen ones too: they get no
        gradient, so it skips them, until a case unfreezes them)."""
        return make_optimizer(spec, params.values())

    def make_scheduler(self, optimizer: torch.optim.Optimizer, spec: OptimSpec, steps: int):
        """The case's learning-rate schedule, or None (verify/training/optim.py)."""
        return make_scheduler(spec, optimizer, steps)

    def unfreeze(self, names: list[str]) -> None:
        """The parameters `names` train from now on. FSDP2 fixes each unit's reduce dtype and
        original dtype when it first runs (`FSDPParamGroup._init_mp_dtypes` at lazy init), from
        the parameters that require grad then: a unit whose first forward ran frozen keeps None
        for both, and once unfrozen under a MixedPrecisionPolicy its gradients are
        reduce-scattered in param_dtype and assigned to the fp32 sharded parameter, which
        torch 2.13 refuses (grad_dtype; tests/upstream/test_fsdp2_unfreeze_after_first_forward.py).
        The groups' dtypes are derived again here, as FSDP2's lazy init would have with these
        parameters trainable."""
        params = self.parameters()
        for n in names:
            params[n].requires_grad_(True)
        for root in self.roots():
            for unit in root.modules():
                state = unit._get_fsdp_state() if hasattr(unit, "_get_fsdp_state") else None
                for group in getattr(state, "_fsdp_param_groups", None) or []:
                    group._init_mp_dtypes()

    def roots(self) -> list[nn.Module]:
        """The modules the engine sharded as roots: the model (a pipeline's stages instead)."""
        return [self.module]

    def ownership(self) -> OwnershipMap | None:
        """Which shard unit owns each parameter and how many elements each rank holds (a
        collective). None if the engine cannot say. FSDP2's reading: verify/engines/fsdp2_ownership.py."""
        from fsdp_verify.engines.fsdp2_ownership import fsdp2_ownership

        return fsdp2_ownership(self.module)

    def checkpointer(self):
        """Saves and loads this engine's model and optimizer (verify/training/resume.py): DCP's
        `get_state_dict` / `set_state_dict`, which FSDP2 and FSDP1 modules both take."""
        from fsdp_verify.training.resume import Checkpointer

        return Checkpointer(self.module)

    def set_requires_gradient_sync(self, sync: bool) -> None:
        if hasattr(self.module, "set_requires_gradient_sync"):
            self.module.set_requires_gradient_sync(sync)

    def set_requires_all_reduce(self, all_reduce: bool) -> None:
        """HSDP's replica all-reduce on or off for the next backward (`replica_sync_last`)."""
        self.module.set_requires_all_reduce(all_reduce)

    def set_reshard_after_backward(self, reshard: bool) -> None:
        """Whether the next backward reshards each unit (`reshard_after_backward_last`)."""
        self.module.set_reshard_after_backward(reshard)

    def reduce_ignored(self, names: list[str], divide: int) -> None:
        """The loop's own reduction of the `ignored` parameters' gradients, which FSDP2 leaves
        alone: each all-reduced (SUM; gloo has no AVG) over every rank, then divided by `divide`
        (the world size under avg, 1 under `grad_reduction: sum`)."""
        params = self.parameters()
        for n in names:
            grad = params[n].grad
            if grad is None:  # frozen
                continue
            dist.all_reduce(grad)
            if divide != 1:
                grad.div_(divide)

    def sum_loss_divisor(self, world_size: int) -> int:
        """What each rank's loss is divided by before backward under `grad_reduction: sum` (the
        engine sums the gradients over the ranks): the data-parallel world size."""
        return world_size


DTensorView = EngineView


def view_of(module: nn.Module) -> EngineView:
    custom = getattr(module, "verify_view", None)
    return custom() if callable(custom) else EngineView(module)


def norm_by_mesh(groups: list[list[torch.Tensor]]) -> torch.Tensor:
    """The total norm of the gradients of `groups` (`by_mesh`): each mesh's norm whole, the root
    of their squares' sum (one group: its norm)."""
    squares = None
    for params in groups:
        norm = torch.nn.utils.get_total_norm([p.grad for p in params])
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        if len(groups) == 1:
            return norm
        squares = norm**2 if squares is None else squares + norm**2
    return squares ** (1.0 / 2)


def by_mesh(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """`params` grouped by the mesh of their DTensor gradients (plain tensors one group), in the
    order first met; one group where they share one. (torchtitan adds its two norms' squares,
    the experts' first: two add alike either way.)"""
    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        groups.setdefault(getattr(p, "device_mesh", None), []).append(p)
    return list(groups.values())
