"""Per-module and per-operation probes for one step of a run, the same on both sides: the
reference installs them on its model (reference/trainer.py), each rank on the model as built
(verify/zoom/probe.py), so both record under the same names.

A module pass (`Case.zoom = "STEP"`) records, for every emulated or real rank's pass over each
micro-batch at STEP, each module call's floating outputs (phase "modules") and, in backward, the
gradient with respect to its outputs and inputs (phase "module_grads", full backward hooks). An
op pass (`"STEP/forward/FQN"` or `"STEP/backward/FQN"`) records every ATen operation run inside
that module's forward or backward (phase "ops", its inputs under "op_inputs") through a
TorchDispatchMode held over the whole pass: autograd's engine restores the thread-local state it
captured when backward began before each node, so a mode entered inside a hook would not see the
backward's ops; a mode entered before the pass does, and a flag the module's hooks set says which
of them are its own.

Under tensor parallelism a value is compared tp rank by tp rank, as each rank holds it: a
DTensor as its local tensor (`to_local`: a colwise output's chunk, a rowwise output's partial
sum before its reduction, a sequence shard), and on the reference each of a `Ranks`' local
tensors (reference/tensor_parallel.py) under that tp rank's pass, a plain tensor under every one.
A plain local tensor does not say how it lies (a sequence shard and a replicated activation look
alike), so it is not gathered into a whole: the local values are what both sides have the same
way, and a gather inside a hook would be a collective that a rank's divergent hooks could hang.

Names: "MB.rRANK:FQN#CALL:oJ" (output J of the CALL-th call of module FQN in rank RANK's pass
over micro-batch MB), ":goutJ" / ":ginJ" for gradients, and "MB.rRANK:cCALL:IDX:OP:oJ" / ":iJ"
for operations. The order in which each pass ran them goes into the trace's meta ("zoom")."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from fsdp_verify.trace import Trace
from fsdp_verify.zoom.experts import ExpertRows, grouped_experts

try:  # private API: feature-tested, with a public fallback that sees forward calls only
    from torch.utils._python_dispatch import TorchDispatchMode as _OpMode

    OP_LEVEL = "dispatch"
except ImportError:  # pragma: no cover (every torch this toolkit supports has it)
    from torch.overrides import TorchFunctionMode as _OpMode

    OP_LEVEL = "function"

ZOOM_PHASES = ("modules", "module_grads", "ops", "op_inputs")
# Operations that move no value: views, aliases and allocations. Their outputs are their inputs
# (or garbage), so they can neither part first nor explain a parting.
_SKIP = {"detach", "alias", "lift_fresh", "empty", "empty_like", "empty_strided", "new_empty", "zeros_like"}


def parse_zoom(zoom: str) -> tuple[int, str | None, str | None]:
    """(step, direction or None, module FQN or None) from a Case's `zoom` field."""
    step, _, rest = zoom.partition("/")
    direction, _, fqn = rest.partition("/")
    return int(step), direction or None, (fqn if direction else None)


def pass_id(microbatch: int, rank: int) -> str:
    return f"{microbatch:03d}.r{rank}"


def _floats(value: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(value)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _keep(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().contiguous()


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor as this rank's local tensor (what the reference's emulation holds per tp rank)."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def one_rank(t: torch.Tensor, n: int) -> list[torch.Tensor]:
    """The value as each of the pass's n ranks holds it: a rank's pass records one."""
    return [_local(t)]


class ModuleWatch:
    """Hooks on every module of `model` (a module pass) or on the one module an op pass looks
    inside; records only during a pass at the zoom step, between `begin` and `end`."""

    def __init__(self, model: nn.Module, zoom: str, ranks: int = 1, split=one_rank, skip: tuple[str, ...] = ()):
        """`ranks`: the ranks one pass covers (the reference's pass of a data-parallel rank runs
        its tp ranks side by side: rank d's pass is ranks d * tp ... d * tp + tp - 1); `split`:
        a value as each of them holds it; `skip`: modules not watched (a pipeline's root, which
        the ranks never call: they call its stages)."""
        self.step, self.direction, self.target = parse_zoom(zoom)
        self.ranks, self.split = ranks, split
        # What the probes themselves cause: a full backward hook on a module whose inputs need no
        # gradient (the root of a token model), and FSDP2 seeing that hook's identity view.
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        warnings.filterwarnings("ignore", message=".*returned a view tensor")
        self.records: dict[tuple[str, str], torch.Tensor] = {}
        self.order: dict[str, list[str]] = {}  # pass id -> ["F:FQN#K", "P:...", "B:..."] in time order
        self._pass: str | None = None  # the pass's first id (its ranks' ids: `_passes`)
        self._passes: list[str] = []
        self._forwarding = False
        self._calls: dict[str, int] = {}
        self._backward_calls: dict[str, int] = {}
        self._pre_calls: dict[str, int] = {}
        self._window: int | None = None  # the call of the target whose ops are being recorded
        # per pass: its forward calls, backward calls, backward pre-calls per module, ops so far
        self._counts: dict[str, tuple[dict, dict, dict, list[int]]] = {}
        self._ops_of = [0]
        self._mode: _OpMode | None = None
        self._forward_hooks: list[tuple[nn.Module, Any, Any]] = []
        self._at = (0, 0)  # the pass's (micro-batch, rank)
        # Grouped experts, recorded expert by expert (verify/zoom/experts.py): the counts each call
        # routes, taken ahead of any hook an engine adds (the ep dispatch).
        self.experts: dict[str, ExpertRows] = {}
        if self.direction is None:
            for fqn, module in grouped_experts(model).items():
                self.experts[fqn] = ExpertRows()
                module.register_forward_pre_hook(self._routed(fqn))
        for fqn, module in model.named_modules():
            if fqn in skip:
                continue
            if self.direction is None:
                self._hook_forward(module, self._forward_hook(fqn))
                module.register_full_backward_pre_hook(self._backward_pre_hook(fqn))
                module.register_full_backward_hook(self._backward_hook(fqn))
            elif fqn == self.target:
                module.register_forward_pre_hook(self._op_forward_pre(fqn))
                self._hook_forward(module, self._forward_hook(fqn))
                if self.direction == "backward":
                    module.register_full_backward_pre_hook(self._backward_pre_hook(fqn))
                    module.register_full_backward_hook(self._backward_hook(fqn))

    def _hook_forward(self, module: nn.Module, hook) -> None:
        self._forward_hooks.append((module, hook, module.register_forward_hook(hook)))

    def forward_hooks_last(self) -> None:
        """Each forward hook moved after those registered since (a tensor-parallel plan's output
        redistribution, FSDP2's post-forward and its output cast): the output recorded as the
        module hands it on, as the reference's probe sees it (its plan's and casts' hooks run
        before its probe's: reference/tensor_parallel.py prepends its own)."""
        moved = []
        for module, hook, handle in self._forward_hooks:
            handle.remove()
            moved.append((module, hook, module.register_forward_hook(hook)))
        self._forward_hooks = moved

    def experts_as_sharded(self, model: nn.Module) -> None:
        """Each grouped experts module as the engine left it: under ep, the experts it holds and
        the ranks whose rows it computes."""
        for fqn in self.experts:
            self.experts[fqn] = ExpertRows.of(model.get_submodule(fqn))

    # ---- the pass -------------------------------------------------------------------------------
    def watching(self, step: int) -> bool:
        return step == self.step

    def begin(self, microbatch: int, rank: int) -> None:
        self.open(microbatch, rank, fresh=True)

    def open(self, microbatch: int, rank: int, fresh: bool = False, forwarding: bool = True) -> None:
        """Record into the pass of (micro-batch, rank): a new one (`fresh`), or where it was left
        (a pipeline stage's backward of a micro-batch, after other micro-batches' forwards: each
        pass keeps its own call counts, so a backward still meets its own forward's calls)."""
        self._at = (microbatch, rank)
        self._passes = [pass_id(microbatch, rank * self.ranks + t) for t in range(self.ranks)]
        self._pass = self._passes[0]
        if fresh or self._pass not in self._counts:
            events: list[str] = []  # one time order for the ranks of one pass
            for pid in self._passes:
                self.order[pid] = events
            self._counts[self._pass] = ({}, {}, {}, [0])
        self._calls, self._backward_calls, self._pre_calls, self._ops_of = self._counts[self._pass]
        self._forwarding = forwarding
        self._window = None
        if self.direction is not None:
            self._mode = _Recorder(self)
            self._mode.__enter__()

    def forward_done(self) -> None:
        self._forwarding = False

    def end(self) -> None:
        if self._mode is not None:
            self._mode.__exit__(None, None, None)
            self._mode = None
        self._pass, self._window, self._forwarding = None, None, False

    @contextlib.contextmanager
    def rank_pass(self, step: int, microbatch: int, rank: int):
        """`begin` ... `end` around one pass at the zoom step (any other step: nothing)."""
        if not self.watching(step):
            yield
            return
        self.begin(microbatch, rank)
        try:
            yield
        finally:
            self.end()

    # ---- hooks ----------------------------------------------------------------------------------
    def _forward_hook(self, fqn: str):
        def hook(_module, args, out):
            if self._pass is None or not self._forwarding:  # not this step, or a recomputation
                return
            k = self._calls.get(fqn, 0)
            self._calls[fqn] = k + 1
            self.order[self._pass].append(f"F:{fqn}#{k}")
            if fqn in self.experts:
                self._expert_rows(fqn, k, "", args[0], out, args[1])
            elif self.direction is None:
                for j, t in enumerate(_floats(out)):
                    self._put("modules", f"{fqn}#{k}:o{j}", t)
                for j, t in enumerate(_floats(args)):  # as the module saw them, after pre-hooks
                    self._put("modules", f"{fqn}#{k}:i{j}", t)
            elif self.direction == "forward" and self._window is not None:
                self._window = None

        return hook

    def _routed(self, fqn: str):
        def hook(_module, args):
            if self._pass is not None and self._forwarding:
                self.experts[fqn].routed(self._calls.get(fqn, 0), args[1])

        return hook

    def _expert_rows(self, fqn: str, call: int, kind: str, rows, out, counts=None) -> None:
        """A grouped experts call's input rows (or their gradient) per (source rank, expert), its
        output (or its gradient) per expert of the rank's own rows: verify/zoom/experts.py."""
        where = self.experts[fqn]
        if counts is not None:
            where.dispatched(call, counts)
        phase = "module_grads" if kind else "modules"
        if out is not None:
            for e, chunk in where.outputs(call, _local(out)):
                self._put(phase, f"{fqn}#{call}:{kind}o{'ut' if kind else ''}0.e{e}", chunk)
        if rows is not None:
            for source, e, chunk in where.inputs(call, _local(rows), self._at[1]):
                name = f"{pass_id(self._at[0], source)}:{fqn}#{call}:{kind}i{'n' if kind else ''}0.e{e}"
                self.records[(phase, name)] = _keep(chunk)

    def _op_forward_pre(self, fqn: str):
        def hook(_module, _args):
            if self._pass is not None and self._forwarding and self.direction == "forward":
                self._window = self._calls.get(fqn, 0)

        return hook

    def _backward_call(self, counts: dict[str, int], fqn: str) -> int:
        """Backward meets a module's calls last first: the k-th time is call (calls - 1 - k)."""
        k = counts.get(fqn, 0)
        counts[fqn] = k + 1
        return max(self._calls.get(fqn, 1) - 1 - k, 0)

    def _backward_pre_hook(self, fqn: str):
        def hook(_module, grad_output):
            if self._pass is None:
                return None
            call = self._backward_call(self._pre_calls, fqn)
            self.order[self._pass].append(f"P:{fqn}#{call}")
            if fqn in self.experts:
                self._expert_rows(fqn, call, "g", None, grad_output[0])
            elif self.direction is None:
                for j, g in enumerate(grad_output):
                    if isinstance(g, torch.Tensor):
                        self._put("module_grads", f"{fqn}#{call}:gout{j}", g)
            elif self.direction == "backward":
                self._window = call
            return None

        return hook

    def _backward_hook(self, fqn: str):
        def hook(_module, grad_input, _grad_output):
            if self._pass is None:
                return None
            call = self._backward_call(self._backward_calls, fqn)
            self.order[self._pass].append(f"B:{fqn}#{call}")
            if fqn in self.experts:
                self._expert_rows(fqn, call, "g", grad_input[0], None)
            elif self.direction is None:
                for j, g in enumerate(grad_input):
                    if isinstance(g, torch.Tensor):
                        self._put("module_grads", f"{fqn}#{call}:gin{j}", g)
            elif any(isinstance(g, torch.Tensor) for g in grad_input):
                # A module none of whose inputs needs a gradient has its hook called as soon as
                # its output's gradient arrives: its window then stays open to the pass's end.
                self._window = None
            return None

        return hook

    def record_op(self, name: str, args: Any, kwargs: Any, out: Any) -> None:
        if self._pass is None or self._window is None:
            return
        short = name.split(".")[1] if name.startswith("aten.") else name
        if short in _SKIP:
            return
        outs = _floats(out)
        if not outs:
            return
        if self.direction == "backward" and torch.is_grad_enabled():
            # Activation checkpointing's recomputation: forward ops run again in backward (under
            # enable_grad; backward's own ops run without). The engine may; the reference never
            # recomputes, so they are marked as such rather than taken for an extra computation.
            name += "[recomputed]"
        prefix = f"c{self._window}:{self._ops_of[0]:05d}:{name}"
        self._ops_of[0] += 1
        self.order[self._pass].append(f"O:{prefix}")
        for j, t in enumerate(outs):
            self._put("ops", f"{prefix}:o{j}", t)
        for j, t in enumerate(_floats((args, kwargs))):
            self._put("op_inputs", f"{prefix}:i{j}", t)

    def _put(self, phase: str, name: str, value: torch.Tensor) -> None:
        """`value` under each rank of the pass, as that rank holds it."""
        for pid, mine in zip(self._passes, self.split(value, self.ranks)):
            self.records[(phase, f"{pid}:{name}")] = _keep(mine)

    # ---- into a trace ---------------------------------------------------------------------------
    def into(self, trace: Trace) -> None:
        for (phase, name), t in self.records.items():
            trace.add(self.step, phase, name, t)
        zoom = trace.meta.setdefault("zoom", {"order": {}})
        zoom["order"].update(self.order)
        zoom["op_level"] = OP_LEVEL

    def to_gather(self) -> dict[str, Any]:
        return {"records": self.records, "order": self.order}


if OP_LEVEL == "dispatch":

    class _Recorder(_OpMode):
        """Every ATen operation while a pass runs; the watch keeps those in the target's window."""

        def __init__(self, watch: ModuleWatch):
            super().__init__()
            self.watch = watch

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.namespace == "aten" and not getattr(func, "is_view", False):
                self.watch.record_op(str(func), args, kwargs, out)
            return out

else:  # pragma: no cover

    class _Recorder(_OpMode):
        def __init__(self, watch: ModuleWatch):
            super().__init__()
            self.watch = watch

        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.watch.record_op(getattr(func, "__name__", str(func)), args, kwargs, out)
            return out
