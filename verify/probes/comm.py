"""Communication probe: every collective each rank issues while the engine trains (forward,
backward, the clip, the optimizer step), with its kind, dtype, bytes and process-group size, for
verify/checks/comm.py to hold against the volume the Case implies (seed 001).

Numbers that agree do not prove sharding works: an engine that all-reduces full gradients
instead of reduce-scattering them, or gathers fp32 parameters under a bf16 policy, computes the
same values at twice the traffic.

What sees what (measured on CPU/gloo, torch 2.13):
* FSDP2 calls `dist.all_gather_single` / `dist.reduce_scatter_single` and, under HSDP,
  `dist.all_reduce`; FSDP1 and the flat engine call `dist.all_gather_into_tensor` /
  `dist.reduce_scatter_tensor`. Those are looked up on the `torch.distributed` module at call
  time, so wrapping the module's functions sees them. A nested call (one wrapped function
  calling another) counts once, as the outer one.
* DTensor (the clip's global norm) issues functional collectives
  (`torch.distributed._functional_collectives.all_reduce` ...), which never pass through those
  functions; DTensor looks them up on that module at call time, so they are wrapped there too.
  A TorchDispatchMode does not see them: DTensor redistributes inside the mode's own handler,
  where the mode is switched off (tried: the clip of an HSDP case showed no collective).

Only the windows the loop opens count: from `before_forward` to `after_forward` (forward), to
`after_backward` (backward), the view's `clip_grad_norm_` (clip) and the optimizer's step
(optimizer). The toolkit's own gathers for recording (verify/sharded/gather.py) happen outside
them and are not measured. Each rank measures its own; `finish` gathers them to rank 0 as
`trace.meta["comm"] = {"ranks": [[record, ...] per rank]}`, a record being
`[step, microbatch, phase, kind, dtype, group_size, bytes]` (bytes: the unsharded side: an
all-gather's output, a reduce-scatter's input, an all-reduce's tensor). Under tensor parallelism
the tp group and the shard group are often the same size, so a record also names the mesh dim its
group spans (`over`: "tp", "shard", "replicate", or "" for a group that is no one dim's, or of one
rank: on a (1, 1, tp) mesh that is the shard and the replicate group alike), an eighth
field, present only in a tp case's records.
"""

from __future__ import annotations

import functools
import math
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh

from fsdp_verify.dtypes import name_of
from fsdp_verify.engines.view import EngineView
from fsdp_verify.probes.base import Probe

# torch.distributed function -> (kind, index of the "big" tensor argument, its keyword name).
_FUNCTIONS = {
    "all_gather_single": ("all_gather", 0, "output_tensor"),
    "all_gather_into_tensor": ("all_gather", 0, "output_tensor"),
    "all_gather": ("all_gather", 0, "tensor_list"),
    "reduce_scatter_single": ("reduce_scatter", 1, "input"),
    "reduce_scatter_tensor": ("reduce_scatter", 1, "input"),
    "reduce_scatter": ("reduce_scatter", 1, "input_list"),
    "all_reduce": ("all_reduce", 0, "tensor"),
    "broadcast": ("broadcast", 0, "tensor"),
    "all_to_all_single": ("all_to_all", 1, "input"),
}
# torch.distributed._functional_collectives function -> kind (DTensor's redistributions call these).
_FUNCTIONAL = {
    "all_reduce": "all_reduce",
    "all_gather_single": "all_gather",
    "all_gather_tensor": "all_gather",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_to_all_single": "all_to_all",
}
_FUNCTIONAL_GROUP_ARG = {"all_reduce": 2, "all_gather_single": 2, "all_gather_tensor": 2}  # else 3


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    return []


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class CommLog:
    """What one rank issued inside the open windows. The wrapped functions and the dispatch mode
    hold this log only (module-level `_log`), never the probe or the model."""

    def __init__(self) -> None:
        self.records: list[list[Any]] = []
        self.where: tuple[int, int, str] | None = None  # (step, micro-batch, phase) while open
        self.depth = 0  # > 0 inside a wrapped call: nested collectives are part of it

        self.mesh: tuple[tuple[int, ...], tuple[str, ...]] | None = None  # a tp case's (shape, dim names)

    def seen(self, kind: str, tensors: list[torch.Tensor], group_size: int, over=None) -> None:
        """`over`: the mesh dim's name, or a callable giving the group's global ranks (asked only
        in a tp case)."""
        if self.where is None or not tensors:
            return
        step, microbatch, phase = self.where
        dtype = name_of(tensors[0].dtype)
        record = [step, microbatch, phase, kind, dtype, group_size, _nbytes(tensors)]
        if self.mesh is not None:  # a group of one rank is every size-1 dim's: named by none
            record.append("" if group_size == 1 else over if isinstance(over, str) else mesh_dim_of(over(), *self.mesh))
        self.records.append(record)


def mesh_dim_of(ranks: list[int], shape: tuple[int, ...], names: tuple[str, ...]) -> str:
    """The name of the mesh dim whose group is `ranks` (rank-major layout, the last dim fastest:
    rank (d, t) = d * tp + t), or "" when the group is no single dim's."""
    ranks = sorted(ranks)
    stride = 1
    for size, name in reversed(list(zip(shape, names))):
        if len(ranks) == size and all(b - a == stride for a, b in zip(ranks, ranks[1:])):
            return name
        stride *= size
    return ""


_log: CommLog | None = None


def _rebind_copies(wrapped: dict[int, Any]) -> None:
    """A library that bound a collective by name (`from torch.distributed._functional_collectives
    import all_to_all_single`: torchtitan's token dispatcher, torchao's float8 amax all-reduce)
    before the wrappers were installed holds the unwrapped function, and its collectives would go
    unrecorded: its binding is pointed at the wrapper (`wrapped`: id of the original -> wrapper).
    A rank's zygote imports such libraries before any probe runs (verify/sharded/zygote.py).
    torch's own modules are left as they are: the contracts model what torch records."""
    if not wrapped:
        return
    for name, module in list(sys.modules.items()):
        if module is None or name.split(".", 1)[0] == "torch":
            continue
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for attr, value in list(namespace.items()):
            if id(value) in wrapped and callable(value):
                namespace[attr] = wrapped[id(value)]


def _install_wrappers() -> None:
    rebound: dict[int, Any] = {}
    for fn_name, (kind, index, keyword) in _FUNCTIONS.items():
        original = getattr(dist, fn_name, None)
        if original is None or getattr(original, "_verify_comm", False):
            continue

        @functools.wraps(original)
        def wrapped(*args: Any, _original=original, _kind=kind, _index=index, _kw=keyword, **kwargs: Any) -> Any:
            log = _log
            if log is None or log.depth > 0:
                return _original(*args, **kwargs)
            big = kwargs.get(_kw, args[_index] if len(args) > _index else None)
            group = kwargs.get("group")
            ranks = lambda: dist.get_process_group_ranks(group or dist.group.WORLD)  # noqa: E731
            log.seen(_kind, _tensors(big), dist.get_world_size(group), ranks)
            log.depth += 1
            try:
                return _original(*args, **kwargs)
            finally:
                log.depth -= 1

        wrapped._verify_comm = True  # type: ignore[attr-defined]
        setattr(dist, fn_name, wrapped)
        rebound[id(original)] = wrapped
    _rebind_copies(rebound)


def _group_dim(group: Any) -> Any:
    """A functional collective's group as `CommLog.seen`'s `over`: its global ranks, on demand,
    which `mesh_dim_of` names by the case's mesh. Not the engine's name for the dim: a framework
    names its own meshes (torchtitan's "fsdp" is the case's "shard")."""
    if isinstance(group, tuple):
        mesh, dim = group
        return lambda: dist.get_process_group_ranks(mesh.get_group(dim))
    if isinstance(group, DeviceMesh) and group.ndim == 1:
        return lambda: dist.get_process_group_ranks(group.get_group())
    if isinstance(group, list):
        return lambda: group
    if isinstance(group, str):
        group = dist.distributed_c10d._resolve_process_group(group)
    return lambda: dist.get_process_group_ranks(group or dist.group.WORLD)


def _group_size(group: Any) -> int:
    """The size of a functional collective's group: (mesh, dim), a mesh, a group name or object."""
    if isinstance(group, tuple):
        mesh, dim = group
        return mesh.size(dim)
    if isinstance(group, DeviceMesh):
        return group.size()
    if isinstance(group, str):
        return dist.distributed_c10d._resolve_process_group(group).size()
    if isinstance(group, list):
        return len(group)
    return dist.get_world_size(group)


def _install_functional_wrappers() -> None:
    rebound: dict[int, Any] = {}
    for fn_name, kind in _FUNCTIONAL.items():
        original = getattr(funcol, fn_name, None)
        if original is None or getattr(original, "_verify_comm", False):
            continue
        index = _FUNCTIONAL_GROUP_ARG.get(fn_name, 3)

        @functools.wraps(original)
        def wrapped(*args: Any, _original=original, _kind=kind, _index=index, **kwargs: Any) -> Any:
            log = _log
            if log is None or log.depth > 0:
                return _original(*args, **kwargs)
            group = kwargs.get("group", args[_index] if len(args) > _index else None)
            size = _group_size(group)
            tensors = _tensors(args[0] if args else kwargs.get("self"))
            if _kind == "all_gather":  # counted by its output, as dist.all_gather_single is
                tensors = [t.new_empty((t.numel() * size,)) for t in tensors]
            log.seen(_kind, tensors, size, _group_dim(group))
            log.depth += 1
            try:
                return _original(*args, **kwargs)
            finally:
                log.depth -= 1

        wrapped._verify_comm = True  # type: ignore[attr-defined]
        setattr(funcol, fn_name, wrapped)
        rebound[id(original)] = wrapped
    _rebind_copies(rebound)


class CommProbe(Probe):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        global _log
        _log = None  # a case that crashed may have left its log behind
        self.log = CommLog()
        if self.case.parallel.tp > 1:
            self.log.mesh = (self.case.parallel.shape, self.case.parallel.names)
        _install_wrappers()
        _install_functional_wrappers()

    # ---- windows ------------------------------------------------------------------------------
    def _open(self, step: int, microbatch: int, phase: str) -> None:
        global _log
        self._close()
        self.log.where = (step, microbatch, phase)
        _log = self.log

    def _close(self) -> None:
        global _log
        self.log.where = None
        _log = None

    # ---- hooks of the loop ----------------------------------------------------------------------
    def after_shard(self, model: torch.nn.Module, view: EngineView) -> None:
        clip = view.clip_grad_norm_
        probe = self

        def clip_grad_norm_(max_norm: float) -> torch.Tensor:
            probe._open(probe.step, 0, "clip")
            try:
                return clip(max_norm)
            finally:
                probe._close()

        view.clip_grad_norm_ = clip_grad_norm_  # type: ignore[method-assign]

    def after_optimizer(self, optimizer: torch.optim.Optimizer, view: EngineView) -> None:
        optimizer.register_step_pre_hook(lambda *_: self._open(self.step, 0, "optimizer"))
        optimizer.register_step_post_hook(lambda *_: self._close())

    step = 0

    def before_forward(self, step: int, microbatch: int) -> None:
        self.step = step
        self._open(step, microbatch, "forward")

    def after_forward(self, step: int, microbatch: int, output: torch.Tensor) -> None:
        self._open(step, microbatch, "backward")

    def after_backward(self, step: int, microbatch: int) -> None:
        self._close()

    def finish(self) -> None:
        self._close()

    def to_gather(self):
        return self.log.records

    def gathered(self, per_rank) -> None:
        self.meta("comm", {"ranks": per_rank})


def padded_shard_numel(shape: tuple[int, ...] | list[int], shard: int, dim: int = 0) -> int:
    """Elements of one rank's shard of a parameter under FSDP2's Shard(0): dim 0 padded up to a
    multiple of the shard group's size, then cut into equal chunks (a 0-dim tensor is one row).
    Under Shard(1) (`shard_placement`, even by construction: verify/engines/placement.py) the
    dim-1 chunk, numel / shard."""
    if dim:
        return math.prod(shape) // shard
    rows = shape[0] if len(shape) else 1
    rest = math.prod(shape[1:]) if len(shape) > 1 else 1
    return -(-rows // shard) * rest
