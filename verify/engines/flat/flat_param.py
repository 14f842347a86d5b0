"""FlatParameter: one shard unit's parameters as a single flat buffer, padded and cut into
world_size equal, contiguous, rank-ordered chunks.

    flat (unsharded):  [ w1 ........ | b1 .. | w2 ...... | pad ]      len = ceil(total / W) * W
    rank 0 keeps:      [ chunk 0 ]
    rank 1 keeps:                     [ chunk 1 ]  ...

Each rank keeps only its chunk, in fp32 (`shard`, the master weights). The optimizer steps one
tensor per original parameter: `shard_views[i]`, the part of parameter i that falls into this
rank's chunk (possibly empty), a view into `shard`, so updating it updates the shard.

For compute, `all_gather()` rebuilds the whole flat buffer (`full`, in `param_dtype`) and
`compute_views()` cuts it into tensors of the original shapes. `full` is an autograd leaf: the
gradients of all those views land in one flat `full.grad`, which is exactly the layout that is
reduce-scattered back into chunks (padding included, where the gradient is zero).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from fsdp_verify.sharded.gather import _all_gather_single


@dataclass
class Slot:
    """One original parameter inside the flat buffer."""

    fqn: str  # original FQN
    shape: tuple[int, ...]
    offset: int  # where it starts in the flat buffer
    requires_grad: bool
    uses: list[tuple[nn.Module, str]] = field(default_factory=list)  # (module, attribute); 2+ if tied

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class FlatParameter:
    def __init__(
        self,
        slots: list[Slot],
        values: list[torch.Tensor],
        group: dist.ProcessGroup,
        param_dtype: torch.dtype,
    ):
        self.slots, self.group, self.param_dtype = slots, group, param_dtype
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        total = sum(s.numel for s in slots)
        self.padded_numel = -(-total // self.world) * self.world
        self.shard_numel = self.padded_numel // self.world
        device = values[0].device
        with torch.no_grad():
            flat = torch.zeros(self.padded_numel, dtype=torch.float32, device=device)
            for slot, value in zip(slots, values):
                flat[slot.offset : slot.offset + slot.numel] = value.reshape(-1)
            lo = self.rank * self.shard_numel
            self.shard = flat[lo : lo + self.shard_numel].clone()  # the rest is dropped: that is the point
        self.shard_views = [
            nn.Parameter(self.shard[a:b], requires_grad=s.requires_grad)
            for s, (a, b) in zip(slots, (self.local_range(s) for s in slots))
        ]
        # The unsharded buffer: allocated only between all_gather() and free().
        self.full = torch.empty(self.padded_numel, dtype=param_dtype, device=device)
        self.full.requires_grad_(any(s.requires_grad for s in slots))
        self.free()

    def local_range(self, slot: Slot) -> tuple[int, int]:
        """Where slot's part of this rank's chunk lies, in shard coordinates (a == b: none)."""
        lo = self.rank * self.shard_numel
        a = min(max(slot.offset - lo, 0), self.shard_numel)
        b = min(max(slot.offset + slot.numel - lo, 0), self.shard_numel)
        return a, b

    # ---- unshard / reshard ---------------------------------------------------------------------
    @property
    def is_unsharded(self) -> bool:
        return self.full.untyped_storage().size() > 0

    def all_gather(self) -> None:
        """Fill `full` from every rank's chunk, cast to param_dtype before it travels (half the
        bytes in bf16, as FSDP2). Refilling the same storage keeps tensors autograd saved in
        forward valid for backward; their version counter must not move, or autograd would think
        they were modified in place."""
        if self.is_unsharded:
            return
        self.full.untyped_storage().resize_(self.padded_numel * self.full.element_size())
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(self.full):
            _all_gather_single(self.full, self.shard.to(self.param_dtype), group=self.group)

    def free(self) -> None:
        self.full.untyped_storage().resize_(0)

    def compute_views(self) -> list[torch.Tensor]:
        """Fresh autograd views of `full` with the original shapes (frozen ones detached)."""
        pieces = self.full.split([s.numel for s in self.slots] + [self.padded_numel - self._end()])
        return [p.view(s.shape) if s.requires_grad else p.detach().view(s.shape) for s, p in zip(self.slots, pieces)]

    def _end(self) -> int:
        return self.slots[-1].offset + self.slots[-1].numel

    # ---- gradients -----------------------------------------------------------------------------
    unsynced_grad: torch.Tensor | None = None

    def accumulate_unsynced_grad(self, reduce_dtype: torch.dtype) -> None:
        """Gradient sync off: keep this micro-batch's unsharded gradient, summed with the earlier
        ones in reduce_dtype (FSDP2's `to_accumulated_grad_if_needed`: upcast, then fp32 += bf16),
        not in param_dtype, where small contributions would round away."""
        grad, self.full.grad = self.full.grad, None
        self.unsynced_grad = grad.to(reduce_dtype) if self.unsynced_grad is None else self.unsynced_grad + grad

    def reduce_scatter_grad(self, reduce_dtype: torch.dtype) -> None:
        """`full.grad` (this rank's unsharded gradient, in param_dtype) -> the average over ranks
        of this rank's chunk, in fp32, accumulated into the shard views' `.grad`. Upcast first,
        sum, then divide by the world size: what the reference does (and FSDP2 on gloo)."""
        grad, self.full.grad = self.full.grad, None
        if self.unsynced_grad is not None:  # earlier micro-batches of this step, not yet reduced
            grad, self.unsynced_grad = self.unsynced_grad + grad, None
        send = grad.to(reduce_dtype).contiguous()
        out = torch.empty(self.shard_numel, dtype=reduce_dtype, device=send.device)
        dist.reduce_scatter_single(out, send, op=dist.ReduceOp.SUM, group=self.group)
        if self.world > 1:
            out.div_(self.world)
        out = out.to(torch.float32)
        trainable = [(v, self.local_range(s)) for v, s in zip(self.shard_views, self.slots) if s.requires_grad]
        if all(v.grad is None for v, _ in trainable):  # a new step: the optimizer dropped the grads
            self.grad_shard = out
            for v, (a, b) in trainable:
                v.grad = out[a:b]
        else:  # another micro-batch of the same step
            self.grad_shard += out
