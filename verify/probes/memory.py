"""Memory probe: the bytes each rank holds, at phase boundaries, for verify/checks/memory.py to
hold against what the wrap plan allows (seeds 003 and 004: sharded params, grads and optimizer
state of 1/N each; unsharded parameters only while a unit computes).

On CPU there is no allocator peak to read (`torch.cuda.max_memory_allocated` has no CPU twin),
so the probe counts storage instead: every tensor the engine's module can reach (its attributes,
its FSDP state, the closures of its hooks; not the toolkit's probes or trace), each storage once,
classified as the sharded parameters (the tensors the optimizer steps), their gradients, buffers,
*unsharded*: an `nn.Parameter` with the full shape of one of the model's parameters that is
none of those (FSDP2's unsharded parameters are Parameters; activations are not; beside tensor
parallelism a DTensor Parameter whose local tensor is a tp rank's whole share), and *other*
floating-point storage (a flat copy, a detached clone, a gather buffer). Storage resized to zero
(FSDP2's freed all-gather outputs) counts zero. Activations that only autograd's C++ graph
holds are not reachable and not counted.

Boundaries: before the first step's first forward, after each unit's forward in the first step
(a forward hook registered after the engine's own, so it sees the unit after its reshard), and
after the optimizer step of the first and the last step: nothing may be held beyond the sharded
state there, neither unsharded nor other. "The first step" is the first this run trains, which
is the first `before_forward` it sees ("first_step" in the record): step 1, or k + 1 in a run
resumed after step k. A resumed run's module is as fresh as a new run's at step 1 (built,
sharded, loaded; FSDP2's lazy init still to come), so its first step is where the same facts
show; read at step 1, a resumed run recorded no boundary and no "no_backward" at all, and the
contracts took every unit for one backward reaches (issue 37: a frozen unit under
`reshard_after_backward_last` expected held, so its all-gather "unexpected"). A walk of the module costs about half a millisecond per
thousand objects (1.2 ms on bench/overhead.py's medium Transformer), and the pattern repeats every
step: what the first step leaves is seen after it, what accumulates over steps is seen after the
last (a 100-step case walks 4 + units times, not 200 + units).
Gradient and optimizer-state bytes are counted after every step (no walk). Each rank records its
own; they travel in the case's one gather (`to_gather`) into
`trace.meta["memory"] = {"ranks": [{"sharded": B, "grads": {step: B}, "optim": {step: B},
"boundaries": [[step, microbatch, where, unsharded B, [shape, ...], other B], ...],
"first_step": N, "no_backward": [unit, ...], "where": {"sharded"|"grads"|"optim": [device type, ...]}}, ...]}`,
"no_backward" naming the units whose forward output requires no grad (no backward runs through
them), "where" the device types the sharded state was found on (CPU offload's contract).
"""

from __future__ import annotations

import gc
import types
import weakref
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle

from fsdp_verify import module_names
from fsdp_verify.engines.view import EngineView
from fsdp_verify.probes.base import Probe, eager_hook
from fsdp_verify.torch_support import private_name
from fsdp_verify.trace import Trace
from fsdp_verify.units import is_group, members, modules_here

_ATOMS = (type, types.ModuleType, str, bytes, int, float, bool, complex, type(None), weakref.ReferenceType)
# Most of what a walk meets, skipped by a set lookup: a shape is a tuple of ints.
_LEAVES = frozenset((str, int, float, bool, type(None), bytes, torch.Size))
# What describes a tensor's layout or the ranks holds no storage of its own (a mesh's rank grid
# is an integer tensor, never counted): a fifth of a walk's objects on FSDP2's medium Transformer.
# DTensorSpec and TensorMeta are private: a release without them has its walk descend into them
# (a shape and a mesh, no storage: slower, the same count).
_LAYOUT = (
    *(
        t
        for t in (
            private_name("torch.distributed.tensor._dtensor_spec", "DTensorSpec"),
            private_name("torch.distributed.tensor._dtensor_spec", "TensorMeta"),
        )
        if t is not None
    ),
    Placement,
    DeviceMesh,
    RemovableHandle,
)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank; a wrapper subclass's first inner tensor, which holds its data
    (torchao's float8 weight wrapper, `_tensor`; a float8 tensor's `_data`): a wrapper itself has
    no storage (the `__tensor_flatten__` protocol of traceable subclasses)."""
    t = getattr(t, "_local_tensor", t)
    while hasattr(t, "__tensor_flatten__"):
        t = getattr(t, t.__tensor_flatten__()[0][0])
    return t


def _storage(t: torch.Tensor) -> tuple[int, int]:
    """(data pointer, bytes) of `t`'s storage; (0, 0) for one already freed, which holds nothing
    (a pipeline stage's received activations under tp: "invalid python storage" on a read)."""
    s = _local(t).untyped_storage()
    try:
        return s.data_ptr(), s.nbytes()
    except RuntimeError:
        return 0, 0


def _grad_of(t: torch.Tensor) -> torch.Tensor | None:
    """A leaf's `.grad`. A view made under no_grad whose base was since changed in place (FSDP1
    keeps such views of a FlatParameter: fuzz --engine fsdp1 seed 20263945, a mostly frozen unit
    under NO_SHARD) raises on any read of its autograd metadata; it holds no gradient of its own."""
    try:
        return t.grad if t.is_leaf else None
    except RuntimeError:
        return None


def held_tensors(root: object, skip: tuple[type, ...] = ()) -> list[torch.Tensor]:
    """Every tensor reachable from `root` through attributes, containers and hook closures
    (functions are followed through their closures only, never their globals).

    Breadth first, a level at a time: one `gc.get_referents` call for all of a level's objects,
    and each type classified once (a walk meets ~2,000 objects of ~40 types), 2.6x faster than
    an object at a time on bench/overhead.py's medium Transformer."""
    stop = (*_ATOMS, *_LAYOUT, torch.dtype, torch.device, *skip)
    kinds: dict[type, int] = {}
    seen: set[int] = {id(root)}
    out: list[torch.Tensor] = []
    level: list[Any] = [root]
    while level:
        containers, found = [], []
        for obj in level:
            kind = kinds.get(type(obj))
            if kind is None:
                kind = kinds[type(obj)] = _kind(type(obj), stop)
            if kind == _FOLLOW:
                containers.append(obj)
            elif kind == _TENSOR:
                out.append(obj)
                local = getattr(obj, "_local_tensor", None)
                if local is not None:
                    found.append(local)
                grad = _grad_of(obj)
                if grad is not None:
                    found.append(grad)
            elif kind == _FUNCTION:
                found.extend(c.cell_contents for c in obj.__closure__ or () if _filled(c))
        found.extend(gc.get_referents(*containers))
        level = []
        for obj in found:
            if type(obj) in _LEAVES or id(obj) in seen:
                continue
            seen.add(id(obj))
            level.append(obj)
    return out


_STOP, _TENSOR, _FUNCTION, _FOLLOW = range(4)


def _kind(t: type, stop: tuple[type, ...]) -> int:
    if issubclass(t, stop):
        return _STOP
    if issubclass(t, torch.Tensor):
        return _TENSOR
    if issubclass(t, types.FunctionType):
        return _FUNCTION
    return _FOLLOW


def _needs_backward(output: Any) -> bool:
    """Whether autograd will run backward through a unit: some output requires grad (a fact of
    the model, its frozen parameters and its inputs, not of the engine)."""
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in tree_flatten(output)[0]
    )


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018
    except ValueError:
        return False
    return True


class MemoryProbe(Probe):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.record: dict[str, Any] = {
            "sharded": 0,
            "grads": {},
            "optim": {},
            "boundaries": [],
            "no_backward": [],
            "where": {"sharded": [], "grads": [], "optim": []},
            "open": {},  # boundary index -> units over several modules open there (see `_after`)
        }
        self.group_left: dict[str, set[str]] = {}  # per group, its members yet to run in this pass
        self.open_groups: set[str] = set()
        self.model: nn.Module | None = None
        self.view: EngineView | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.full_shapes: set[tuple[int, ...]] = set()
        self.tp_shapes: set[tuple[int, ...]] = set()  # a tp rank's whole share of each parameter
        # The tensors the optimizer steps, as sharding left them: FSDP2 registers the unsharded
        # parameters on the module while a unit computes, so `view.parameters()` then names those.
        self.sharded_params: list[torch.Tensor] = []
        self.step = 0
        self.microbatch = 0
        self.first_step: int | None = None  # the first step this run trains (see the module docstring)
        self.baseline: set[int] = set()

    # ---- counting -----------------------------------------------------------------------------
    def _known(self) -> dict[int, int]:
        """Storages that are sharded state or buffers (never counted as unsharded)."""
        known: dict[int, int] = {}
        assert self.model is not None
        for p in self.sharded_params:
            for t in (p, p.grad):
                if t is not None:
                    ptr, n = _storage(t)
                    known[ptr] = n
        for b in self.model.buffers():
            ptr, n = _storage(b)
            known[ptr] = n
        return known

    def unsharded(self) -> tuple[int, list[list[int]], int]:
        """What the module holds beyond its sharded state and buffers: bytes of full-shape
        parameters (FSDP2's unsharded parameters, a kept original) and their shapes, and bytes
        of any other floating-point storage (a flat copy, a detached clone, a gather buffer)."""
        known = self._known()
        params: dict[int, int] = {}
        other: dict[int, int] = {}
        shapes: list[list[int]] = []
        for t in held_tensors(self.model, skip=(Probe, Trace, EngineView, torch.optim.Optimizer)):
            local = getattr(t, "_local_tensor", None)
            if local is not None and isinstance(t, nn.Parameter) and tuple(local.shape) in self.tp_shapes:
                # an unsharded parameter beside tp: a DTensor over "tp" whose local tensor is a tp
                # rank's whole share (FSDP2 registers these while a unit computes)
                ptr, n = _storage(local)
                if n and ptr not in known and ptr not in params and ptr not in self.baseline:
                    params[ptr] = n
                    other.pop(ptr, None)
                    shapes.append(list(local.shape))
                continue
            if local is not None or not t.is_floating_point():
                continue  # a DTensor is counted by its shard; a mesh's rank tensor is no parameter
            ptr, n = _storage(t)
            if n == 0 or ptr in known or ptr in params or ptr in self.baseline:
                continue
            if isinstance(t, nn.Parameter) and tuple(t.shape) in self.full_shapes:
                params[ptr] = n
                other.pop(ptr, None)
                shapes.append(list(t.shape))
            else:
                other[ptr] = n
        return sum(params.values()), sorted(shapes), sum(other.values())

    def _boundary(self, where: str) -> None:
        n, shapes, other = self.unsharded()
        self.record["boundaries"].append([self.step, self.microbatch, where, n, shapes, other])

    def _where(self, what: str, tensors: list[torch.Tensor]) -> None:
        """The device types `tensors` (sharded state of kind `what`) are on, added to the record."""
        seen = set(self.record["where"][what]) | {_local(t).device.type for t in tensors}
        self.record["where"][what] = sorted(seen)

    @staticmethod
    def _bytes(tensors: list[torch.Tensor]) -> int:
        storages = dict(_storage(t) for t in tensors)
        return sum(storages.values())

    # ---- hooks of the loop ----------------------------------------------------------------------
    def after_build(self, model: nn.Module) -> None:
        self.full_shapes = {tuple(p.shape) for p in model.parameters()}
        self.tp_shapes = tp_local_shapes(self.case, model)
        # A model's own constant tensors kept as plain attributes (a mask, a table) are the
        # user's, not the engine's: what the model held as built, beyond its parameters and
        # buffers, is never counted as "other".
        mine = {_storage(t)[0] for t in [*model.parameters(), *model.buffers()]}
        self.baseline = {
            _storage(t)[0]
            for t in held_tensors(model, skip=(Probe, Trace))
            if t.is_floating_point() and not isinstance(t, nn.Parameter) and _storage(t)[0] not in mine
        }

    def after_shard(self, model: nn.Module, view: EngineView) -> None:
        self.model, self.view = model, view
        self.sharded_params = list(view.parameters().values())
        self.record["sharded"] = self._bytes(self.sharded_params)
        self._where("sharded", self.sharded_params)
        for unit in self.case.wrap_plan:
            for member, module in zip(members(unit), modules_here(model, unit)):  # under pp: this rank's
                module = getattr(module, "_fsdp_wrapped_module", module)
                if is_group(unit):
                    module.register_forward_pre_hook(eager_hook(self.case, self._opening(unit)))
                module.register_forward_hook(eager_hook(self.case, self._after(unit, member)))

    def _opening(self, unit: str):
        """A unit over several modules is unsharded from its first member's forward on (FSDP2's
        pre-forward fires per member, unsharding at the first): open until its last has run."""
        probe = weakref.ref(self)

        def hook(_m: nn.Module, _a: Any) -> None:
            p = probe()
            if p is not None:
                p.open_groups.add(unit)

        return hook

    def _after(self, unit: str, member: str):
        """The boundary after `unit`'s forward: at once for a unit of one module, after the last
        of a group's members to run in this pass (torch's `_register_group_forward_hooks` runs
        the post-forward, and reshards, when every member has run), with the groups still open
        then recorded beside it (`open`: their parameters are legitimately unsharded there)."""
        probe = weakref.ref(self)

        def hook(_m: nn.Module, _a: Any, output: Any) -> None:
            p = probe()
            if p is None:
                return
            if is_group(unit):
                left = p.group_left.setdefault(unit, set(members(unit)))
                left.discard(member)
                if left:
                    return
                del p.group_left[unit]
                p.open_groups.discard(unit)
            if p.step == p.first_step:  # first step only (see the module docstring)
                p._boundary(f"after forward of {unit or '<root>'}")
                if p.open_groups:
                    p.record["open"][str(len(p.record["boundaries"]) - 1)] = sorted(p.open_groups)
                if p.microbatch == 0 and not _needs_backward(output):
                    p.record["no_backward"].append(unit)

        return hook

    def after_optimizer(self, optimizer: torch.optim.Optimizer, view: EngineView) -> None:
        self.optimizer = optimizer

    def before_forward(self, step: int, microbatch: int) -> None:
        self.step, self.microbatch = step, microbatch
        self.group_left, self.open_groups = {}, set()
        if self.first_step is None:
            self.first_step = self.record["first_step"] = step
        if microbatch == 0 and step == self.first_step:
            # Before later steps the module is as the previous step's "after the optimizer step"
            # boundary saw it (the loop only draws the next batch in between), and a walk costs
            # a millisecond: it is not walked twice.
            self._boundary("before forward")

    def after_backward(self, step: int, microbatch: int) -> None:
        if self.case.sync_every_microbatch or microbatch == self.case.microbatches - 1:
            assert self.view is not None
            grads = [p.grad for p in self.view.parameters().values() if p.grad is not None]
            self.record["grads"][str(step)] = self._bytes(grads)
            self._where("grads", grads)

    def after_step(self, step: int) -> None:
        assert self.optimizer is not None and self.view is not None
        states = [
            v
            for p in self.view.parameters().values()
            for v in self.optimizer.state.get(p, {}).values()
            if isinstance(v, torch.Tensor) and v.dim() > 0  # not the scalar step count
        ]
        self.record["optim"][str(step)] = self._bytes(states)
        self._where("optim", states)
        self.microbatch = 0
        if step in (self.first_step, self.case.steps):  # see the module docstring
            self._boundary("after the optimizer step")

    def finish(self) -> None:
        self.model = self.view = self.optimizer = None
        self.sharded_params = []

    def to_gather(self):
        return self.record

    def gathered(self, per_rank) -> None:
        self.meta("memory", {"ranks": per_rank})


def forward_facts(trace: Trace) -> tuple[list[str], set[str]] | None:
    """What decides FSDP2's backward, from rank 0's record (None without one): the units in the
    order their forwards finished in the first micro-batch of the run's first step (FSDP2's
    post-forward order; each unit once, at its first time: a checkpointed unit's recomputation
    in backward runs the hook again; step 1, or k + 1 resumed after step k) and the units no
    backward runs through ("no_backward")."""
    raw = trace.meta.get("memory")
    if raw is None or not raw.get("ranks"):
        return None
    record = raw["ranks"][0]
    prefix = "after forward of "
    first = record.get("first_step", 1)
    order: list[str] = []
    for step, microbatch, where, *_ in record["boundaries"]:
        if step == first and microbatch == 0 and where.startswith(prefix):
            unit = where.removeprefix(prefix)
            unit = "" if unit == "<root>" else unit
            if unit not in order:
                order.append(unit)
    return order, set(record.get("no_backward", []))


def tp_local_shapes(case, model: nn.Module) -> set[tuple[int, ...]]:
    """Each parameter's shape on one tp rank (the plan's split dim divided by tp), in a tp case:
    what FSDP2 all-gathers a unit's parameters back to beside tensor parallelism."""
    if case.parallel.tp <= 1:
        return set()
    from fsdp_verify.checks.tp_comm import local_shape
    from fsdp_verify.engines.tensor_parallel import split_parameters

    split = split_parameters(case)
    return {tuple(local_shape(list(p.shape), split.get(n), case.tp)) for n, p in module_names.named_parameters(model)}
