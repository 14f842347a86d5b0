"""Memory contract: what each rank holds (verify/probes/memory.py) against what FSDP2's plan
allows (seeds 003 and 004), per rank:

| what                              | allowed                                                        |
|-----------------------------------|----------------------------------------------------------------|
| sharded parameters                | exactly the padded shards: dim 0 padded to a multiple of S, /S  |
| gradients after reduction         | at most the padded shards of the parameters with a gradient     |
| optimizer state                   | at most one padded shard per state tensor (SGD 1, Adam(W) 2)    |
| anything else, before forward and | nothing (neither unsharded parameters nor other floating-point |
|   after the optimizer step        |   storage the module holds)                                    |
| unsharded, after unit u's forward | u's wrapped ancestors (still computing), and with               |
|                                   | reshard_after_forward=False every unit whose forward has run,  |
|                                   | u included: each unit's padded full parameters in param_dtype  |

One thing more is FSDP2's own: under an int `reshard_after_forward` k (1 < k < S) a unit keeps,
after forward, its parameters sharded over k ranks (`_sharded_post_forward_param_data`), freed
only when the unit is unsharded again. A unit that no backward runs through (its forward output
requires no grad: a frozen embedding fed token ids) is not unsharded again before the next
forward, and `FSDPParam.to_sharded` (called by the root's final backward callback) leaves that
copy alive: 1/k of the unit's padded parameters in param_dtype, counted as *other* storage after
the optimizer step and before the next forward (torch 2.13; found by a fresh-seed sweep, 3 of 300
cases, tests/regressions/8608cf484d42.json). The plan allows exactly that there, no more. Such a
unit that backward reaches by another unit's prefetch is all-gathered and never copied out: what a
dimension package's all-gather leaves on its parameters until a copy-out (float8's scales, 4 B a
weight) stays there too, until the next forward (`unwaited_metadata`; tests/regressions/30f308dbc7bb.json).

Under `shard_placement` a Shard(1) parameter's shard is its dim-1 chunk, numel / S (even by
construction, verify/engines/placement.py), not dim 0 padded to S rows. Under `offload`
(CPUOffloadPolicy) the bytes are the same and the sharded parameters, gradients and optimizer
state must be found on the CPU (`offload_findings`; the probe records their device types).
Under `replica_sync_last` FSDP2 keeps each unit's reduce-scattered partial sum between
micro-batches (reduce_dtype, the unit's shards with gradients), freed on the last micro-batch:
nothing more at the boundaries judged without `prefetch`; with it, after a forward of a later
micro-batch they are other storage there (a fresh-seed sweep's false alarms, seed 20263711,
(1, 2) meshes: 56 to 9,492 B, each the unit shards with gradients in reduce_dtype). Under `reshard_after_backward_last` the units a non-last
micro-batch's backward left unsharded (verify/checks/comm.py `held_after_backward`: those whose
own backward ran, or every unit when kept unsharded after forward) stay unsharded into the next micro-batch until their own
forward reshards them: after unit u's forward there, every such unit whose forward has not run
yet is allowed too; after the optimizer step nothing (the last backward reshards).

Under `prefetch` (explicit prefetching k units ahead, verify/engines/prefetch.py) a unit's
pre-forward all-gathers the units of its forward list, and they stay all-gathered, their output
not yet copied out into Parameters, until their own pre-forward: *other* storage, not unsharded
parameters. So after unit u's forward, and only there, other storage is judged, exactly as FSDP2
2.13 holds it (`Budget.other_after`), from FSDP2's forward replayed in the *run* order measured
(verify/checks/prefetch.py, its docstring says what FSDP2 does and why): the output of every
gather still pending, the all-gather output of the unit copied out last (FSDP2 keeps it in
`all_gather_state` until the next copy-out; the root's post-forward frees it; a unit found
unsharded copies nothing out), and under an int k the post-forward shards of the units resharded
to them. Each output is the unit's padded full parameters in param_dtype. The lists follow the
registration order; where the run order differs (the Transformer's SwiGLU: `w2` registered
before the `w3` it runs after) a list names a unit that already ran, gathered again if it was
resharded and pending from then on, and "last copied out" is `w2` where registration order said
`w3` (issue 48: 36 B held, 24 B allowed, tests/regressions/36a0532e74ce.json; measured exact at
every boundary of its variants: 1 to 4 ranks, (2, 2) and (2, 1), k 1 and 2, an int
reshard_after_forward 2, fp32, bf16, fp16). At S = 1 nothing is all-gathered (copied locally):
nothing allowed. A unit gathered earlier than its lists say (a list one unit too long) is found
there; the same collectives are issued, so the comm contract cannot see it.

Beside tensor parallelism every size is a tp rank's: a parameter the plan splits is sharded by
FSDP2 as its tp-local tensor (`params_by_unit`'s shapes), and a unit unsharded while it computes
holds DTensors over "tp" whose local tensors are those shares (the probe counts them as unsharded
parameters). Measured, torch 2.13, (1, 2) and (2, 2) meshes with and without sequence and loss
parallelism, reshard_after_forward False: every boundary exactly as the plan allows.

S is the shard group (the data-parallel mesh's last dimension); the dtype of the sharded state is the model's
(fp32 master weights). A finding names the boundary and the unit when more is held: an engine
that keeps an unsharded copy alive after resharding, or holds full gradients. Under
`sync_every_microbatch=False` the unsharded gradients accumulated between micro-batches are
legitimate (seed 000), so the boundaries of later micro-batches are recorded but not judged.
Activations (held by autograd's C++ graph) are not counted on CPU; the peak printed is the
sharded state plus the largest unsharded total seen at a boundary.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from fsdp_verify import units
from fsdp_verify.case import Case
from fsdp_verify.case_specs import OptimSpec
from fsdp_verify.checks.comm import (
    _size,
    backward_group_of,
    held_after_backward,
    ignored_params,
    params_by_unit,
    placement_dims,
    prefetched_only,
    unfrozen_at,
    unit_reshards,
)
from fsdp_verify.checks.prefetch import Boundary, ForwardPass, forward_pass
from fsdp_verify.compare.finding import Finding
from fsdp_verify.dims import registry
from fsdp_verify.engines.prefetch import prefetch_lists
from fsdp_verify.probes.comm import padded_shard_numel
from fsdp_verify.probes.memory import forward_facts
from fsdp_verify.trace import Trace

COMPARATOR = "MemoryContract"
TP_SHARES = " (of a tp rank's shares)"
STATES = {"sgd": 1, "adam": 2, "adamw": 2, "adagrad": 1, "rmsprop": 2}


def optimizer_states(optim: OptimSpec) -> int:
    """Parameter-shaped state tensors the optimizer keeps per parameter, at most (scalar `step`
    tensors aside): SGD's momentum; Adam(W)'s two moments, and AMSGrad's running max; Adagrad's
    sum; RMSprop's square average and momentum."""
    return STATES[optim.name] + int(optim.amsgrad)


@dataclass
class Budget:
    """Bytes one rank may hold, from the Case and the model's parameter shapes."""

    sharded: int  # exactly
    grads: int  # at most
    optim: int  # at most
    unsharded_by_unit: dict[str, int]  # a unit's padded full parameters in param_dtype
    unsharded_total: int  # the whole model unsharded, in its own dtype (what one device would hold)
    unsharded_grads: int  # the full gradients of the parameters with one
    shard: int
    held_between: frozenset[str] = frozenset()  # reshard_after_backward_last: held into micro-batch m > 0
    held_unfrozen: frozenset[str] = frozenset()  # the same from `unfreeze_step` on
    # prefetch: the units in the order their forwards finished (measured), those with a parameter
    # group, and each one's forward list
    order: tuple[str, ...] = ()
    grouped: frozenset[str] = frozenset()
    forward_lists: dict[str, list[str]] = field(default_factory=dict)
    # replica_sync_last: step -> the partial reduce outputs kept between micro-batches
    partial_sums: dict[int, int] = field(default_factory=dict)
    # each unit's reshard_after_forward as the engine built it (verify/checks/comm.py `unit_reshards`)
    reshards: dict[str, bool | int] = field(default_factory=dict)
    # step -> the metadata the gathers nobody waits on leave until the next forward (`unwaited_metadata`)
    unwaited: dict[int, int] = field(default_factory=dict)

    def kept_after_forward(self, case: Case, unit: str) -> bool:
        rsf = self.reshards.get(unit, case.reshard_after_forward)
        return rsf is False or (rsf is not True and rsf == 1)  # True == 1 in Python

    @property
    def per_rank(self) -> int:
        return self.sharded + self.grads + self.optim

    def single_device(self, case: Case) -> int:
        """Params, grads and optimizer state of the unsharded model: one device's persistent bytes."""
        return self.unsharded_total + self.unsharded_grads * (1 + optimizer_states(case.optim))

    def post_forward_left(self, case: Case, rec: dict) -> int:
        """Bytes of the post-forward shards FSDP2 leaves on units no backward ran through (see
        the module docstring), allowed as *other* storage between steps."""
        left = 0
        for u in set(rec.get("no_backward", [])):
            rsf = self.reshards.get(u, case.reshard_after_forward)
            if not isinstance(rsf, bool) and 1 < rsf < self.shard:
                left += self.unsharded_by_unit.get(u, 0) // rsf
        return left

    def allowed_after(
        self, case: Case, unit: str, done: list[str], microbatch: int = 0, step: int = 1, opened: Iterable[str] = ()
    ) -> int:
        """Unsharded bytes allowed right after `unit`'s forward, `done` the units whose forward
        finished before it in this micro-batch, `opened` the units over several modules whose
        first member has run and whose last has not (unsharded from their pre-forward on, as a
        unit is while it computes: torchtitan's tied `[tok_embeddings, norm, lm_head]` stays
        unsharded through every block)."""
        live = {v for v in self.unsharded_by_unit if units.inside(unit, v)} | (set(opened) - {unit})
        # still unsharded from the previous backward, their forward to come
        live |= self.held_now(case, microbatch, step) - set(done) - {unit}
        live |= {v for v in (*done, unit) if self.kept_after_forward(case, v)}
        return sum(self.unsharded_by_unit.get(v, 0) for v in live)

    def other_after(self, case: Case, boundary: Boundary, microbatch: int, step: int) -> int:
        """Other storage allowed right after a unit's forward under `prefetch`, from FSDP2's
        forward replayed in run order (verify/checks/prefetch.py, `forward_pass`): the outputs of
        the gathers still pending, the all-gather output FSDP2 keeps for the unit it copied out
        last (freed by the next copy-out and by the root's post-forward), under an int k the
        post-forward shards of the units resharded to them, and under `replica_sync_last` the
        partial reduce outputs of the previous micro-batches."""
        partial = 0
        if microbatch > 0 and getattr(case, "replica_sync_last", False):
            partial = self.partial_sums.get(step, 0)  # the previous backwards' partial reduce outputs
        if self.shard == 1:
            # nothing is all-gathered: each unit copies its shards locally (measured); the partial
            # sums are kept all the same (the resume sweep's 18ce68532461, seed 20263963: (2, 1))
            return partial
        outputs = set(boundary.pending) | ({boundary.kept} if boundary.kept is not None else set())
        allowed = partial + sum(self.unsharded_by_unit.get(v, 0) for v in outputs)
        rsf = case.reshard_after_forward
        if boundary.post_forward and not isinstance(rsf, bool):
            allowed += sum(self.unsharded_by_unit.get(v, 0) // rsf for v in boundary.post_forward)
        return allowed

    def forward_pass(self, case: Case, microbatch: int, step: int) -> ForwardPass:
        """FSDP2's forward of this micro-batch replayed in the measured run order."""
        held = self.held_now(case, microbatch, step)
        rsf = case.reshard_after_forward
        k = not isinstance(rsf, bool) and 1 < rsf < self.shard
        kept = microbatch > 0 and getattr(case, "reshard_after_backward_last", False)
        start = frozenset(self.grouped - held) if kept and k else frozenset()  # still in post-forward shards
        return forward_pass(self.order, set(self.grouped), self.forward_lists, self.shard, rsf, held, start)

    def held_now(self, case: Case, microbatch: int, step: int) -> frozenset[str]:
        """The units still unsharded from the previous micro-batch's backward (none at m = 0)."""
        if microbatch == 0:
            return frozenset()
        return self.held_unfrozen if unfrozen_at(case, step) else self.held_between


def budget(case: Case, got: Trace) -> Budget:
    shard = case.mesh[-1]
    param_size = _size(case.precision.param_dtype or "fp32")
    dtypes = {name: dtype for name, _shape, dtype, *_ in got.meta.get("build", [[]])[0]}
    whole = {name: list(shape) for name, shape, *_ in got.meta.get("build", [[]])[0]}  # beside tp: not a tp rank's
    with_grad = {n for s, phase, n in got.records if phase == "grads"}
    sharded = grads = full = full_grads = 0
    by_unit: dict[str, int] = {}
    units = params_by_unit(case, got)
    dims = placement_dims(case, units)
    for unit, params in units.items():
        for name, shape in params:
            own = getattr(torch, dtypes[name].removeprefix("torch.")).itemsize
            rows = padded_shard_numel(shape, shard, dims[name])
            sharded += rows * own
            grads += rows * own if name in with_grad else 0
            full += padded_shard_numel(whole[name], 1) * own
            full_grads += padded_shard_numel(whole[name], 1) * own if name in with_grad else 0
            by_unit[unit] = by_unit.get(unit, 0) + rows * shard * param_size
    for name, shape in ignored_params(case, got):  # held whole on every rank, never unsharded
        own = getattr(torch, dtypes[name].removeprefix("torch.")).itemsize
        whole = padded_shard_numel(shape, 1) * own
        sharded += whole
        full += whole
        grads += whole if name in with_grad else 0
        full_grads += whole if name in with_grad else 0
    # Adagrad creates its state for every parameter when it is built, frozen ones included;
    # the others on a parameter's first gradient.
    optim = optimizer_states(case.optim) * (sharded if case.optim.name == "adagrad" else grads)
    held = unfrozen = frozenset()
    if getattr(case, "reshard_after_backward_last", False):
        held = frozenset(held_after_backward(case, units, got))
        unfrozen = frozenset(units)  # backward runs through every unit once nothing is frozen
    order: tuple[str, ...] = ()
    lists: dict[str, list[str]] = {}
    facts = forward_facts(got)
    if getattr(case, "prefetch", None) is not None and facts is not None:
        names = [name for name, *_ in got.meta.get("build", [[]])[0]]  # model order
        order = tuple(facts[0])
        lists = {
            u: fwd for u, (fwd, _bwd) in prefetch_lists(case.wrap_plan, names, case.prefetch, case.ignored).items()
        }
    partial: dict[int, int] = {}
    if getattr(case, "replica_sync_last", False):
        reduce_size = _size(case.precision.reduce_dtype or case.precision.param_dtype or "fp32")
        for step in range(1, case.steps + 1):
            stepped = {n for s, phase, n in got.records if s == step and phase == "grads"}
            partial[step] = reduce_size * sum(
                padded_shard_numel(shape, shard, dims[n]) for ps in units.values() for n, shape in ps if n in stepped
            )
    grouped = frozenset(u for u, params in units.items() if params)
    return Budget(
        sharded,
        grads,
        optim,
        by_unit,
        full,
        full_grads,
        shard,
        held,
        unfrozen,
        order,
        grouped,
        lists,
        partial,
        unit_reshards(case, got),
        unwaited_metadata(case, got, units),
    )


def unwaited_metadata(case: Case, got: Trace, units: dict[str, list[tuple[str, list[int]]]]) -> dict[int, int]:
    """Per step, the bytes the backward's gathers nobody waits on leave behind until the next
    forward copies the units out: a unit backward reaches only by a prefetch (verify/checks/comm.py
    `prefetched_only`) is all-gathered from its full shards and never copied out, and a
    dimension package's gather metadata stays on its parameters (`gather_metadata`: float8's
    scales). Other storage after the backward and the optimizer step; nothing at S = 1, where
    no gather runs."""
    shard = case.mesh[-1]
    if shard == 1 or next(registry.on(case), None) is None:  # no package on: nothing left by a gather
        return {}
    reshards = unit_reshards(case, got)
    out = {}
    for step in range(got.first_step, case.steps + 1):
        gathered = {
            u
            for u in prefetched_only(units, got, case, step)
            if backward_group_of(reshards.get(u, case.reshard_after_forward), shard) == shard
        }
        first = step == got.first_step
        storages: dict[str, int] = {}  # one storage a view of which several units keep counts once
        for u in gathered:
            for left in registry.contributions(case, got, "gather_metadata", units[u], first):
                storages.update(left)
        out[step] = sum(storages.values())
    return out


def check_memory(case: Case, ref: Trace, got: Trace) -> list[Finding]:
    from fsdp_verify.engines.contracts import case_contracts

    if not case_contracts(case, got).memory:
        return []
    raw = got.meta.get("memory")
    if raw is None:
        return [_finding(0, "<probe>", "the sharded trace holds no memory record (was the MemoryProbe run?)")]
    b = budget(case, got)
    findings: list[Finding] = []
    for rank, rec in enumerate(raw["ranks"]):
        if rec["sharded"] != b.sharded:
            findings.append(
                _finding(
                    0,
                    "sharded",
                    f"rank {rank} holds {rec['sharded']:,} B of sharded parameters, the plan {b.sharded:,} B",
                )
            )
        for what, cap, label in (("grads", b.grads, "gradients"), ("optim", b.optim, "optimizer state")):
            for step, n in sorted(rec[what].items(), key=lambda kv: int(kv[0])):
                if n > cap:
                    findings.append(
                        _finding(int(step), what, f"rank {rank} holds {n:,} B of {label}, the shards allow {cap:,} B")
                    )
                    break
        for step, m, where, held, shapes, allowed, unit in judged_boundaries(case, b, rec):
            if held > allowed:
                findings.append(
                    _finding(
                        step,
                        f"unsharded:{unit or where}",
                        f"rank {rank}, micro-batch {m}, {where}: {held:,} B of unsharded parameters alive"
                        f" ({len(shapes)} full-shape parameters, e.g. {shapes[:3]}), the plan allows {allowed:,} B"
                        " (an unsharded copy kept after resharding?)",
                    )
                )
                break
        findings += offload_findings(case, rank, rec)
        findings += prefetch_findings(case, b, rank, rec)
        left = b.post_forward_left(case, rec)
        for step, m, where, _held, _shapes, other in rec["boundaries"]:
            # "before forward" is the run's first step's (verify/probes/memory.py): a module fresh
            # from sharding (and a load, resumed), nothing left yet of an earlier step
            allowed = 0 if where == "before forward" else left + b.unwaited.get(step, 0)
            if not where.startswith("after forward") and other > allowed and (m == 0 or case.sync_every_microbatch):
                plan = (
                    f"the plan allows {allowed:,} B here (what FSDP2 leaves on units no backward ran through:"
                    " their post-forward shards, a package's gather metadata)"
                    if allowed
                    else "the plan allows none here"
                )
                findings.append(
                    _finding(
                        step,
                        f"other:{where}",
                        f"rank {rank}, micro-batch {m}, {where}: the module holds {other:,} B of floating-point"
                        f" storage beyond its shards, gradients and buffers; {plan}",
                    )
                )
                break
    return findings


OFFLOADED = {"sharded": "sharded parameters", "grads": "gradients", "optim": "optimizer state"}


def offload_findings(case: Case, rank: int, rec: dict) -> list[Finding]:
    """Under `offload` (CPUOffloadPolicy) the sharded parameters, their gradients and the
    optimizer state live on the CPU: any of them found on another device is a finding. (On a
    CPU-only host the compute device is the CPU too, so this cannot fail there; what offload
    changes in bytes is nothing: the same shards, held elsewhere.)"""
    if not getattr(case, "offload", False):
        return []
    out = []
    for what, label in OFFLOADED.items():
        elsewhere = [d for d in rec.get("where", {}).get(what, []) if d != "cpu"]
        if elsewhere:
            out.append(
                _finding(
                    0,
                    f"offload:{what}",
                    f"rank {rank} holds {label} on {', '.join(elsewhere)}; CPUOffloadPolicy keeps them on the CPU",
                )
            )
    return out


def prefetch_findings(case: Case, b: Budget, rank: int, rec: dict) -> list[Finding]:
    """Under `prefetch`, the other storage after each unit's forward against `Budget.other_after`
    (the prefetched all-gather outputs, exactly; see the module docstring). Micro-batches after
    the first only when syncing every micro-batch, as for the other boundaries."""
    if getattr(case, "prefetch", None) is None:
        return []
    prefix = "after forward of "
    seen: set[str] = set()
    replayed: dict[str, Boundary] = {}
    last = None
    for step, m, where, _held, _shapes, other in rec["boundaries"]:
        if (step, m) != last:
            last, seen = (step, m), set()
            replayed = {bd.unit: bd for bd in reversed(b.forward_pass(case, m, step).boundaries)}
        if not where.startswith(prefix):
            continue
        unit = where.removeprefix(prefix)
        unit = "" if unit == "<root>" else unit
        if unit in seen or unit not in replayed:
            # A unit's forward run again in backward (a checkpointed recompute) is no boundary of
            # the forward replayed: `case_contracts` holds no prefetch case under activation
            # checkpointing to the contracts, so none comes here.
            continue
        seen.add(unit)
        allowed = b.other_after(case, replayed[unit], m, step)
        if other > allowed and (m == 0 or case.sync_every_microbatch):
            return [
                _finding(
                    step,
                    f"prefetched:{where.removeprefix(prefix)}",
                    f"rank {rank}, micro-batch {m}, {where}: the module holds {other:,} B of floating-point storage"
                    f" beyond its shards, gradients and buffers; prefetching {case.prefetch} unit(s) ahead allows"
                    f" {allowed:,} B (the all-gather outputs of the units prefetched and not yet used, and of the"
                    " unit copied out last): a unit gathered earlier or more often than its lists say?",
                )
            ]
    return []


def judged_boundaries(case: Case, b: Budget, rec: dict) -> list[tuple[int, int, str, int, list, int, str | None]]:
    """Each judged boundary with what it held and what it may hold (unit: None when quiet)."""
    out = []
    done: list[str] = []
    last = None
    opened = rec.get("open", {})  # a group open across other units' forwards (verify/probes/memory.py)
    for index, (step, m, where, held, shapes, _other) in enumerate(rec["boundaries"]):
        if (step, m) != last:
            done, last = [], (step, m)
        if m > 0 and not case.sync_every_microbatch:
            continue  # accumulated unsharded gradients are allowed here (see the module docstring)
        prefix = "after forward of "
        if where.startswith(prefix):
            unit = where.removeprefix(prefix)
            unit = "" if unit == "<root>" else unit
            allowed = b.allowed_after(case, unit, done, m, step, opened.get(str(index), ()))
            done.append(unit)
            out.append((step, m, where, held, shapes, allowed, unit or "<root>"))
        else:
            out.append((step, m, where, held, shapes, 0, None))
    return out


def _finding(step: int, name: str, message: str) -> Finding:
    return Finding(step, "memory", name, False, "contract", COMPARATOR, message)


def memory_summary(case: Case, ref: Trace, got: Trace) -> str | None:
    from fsdp_verify.engines.contracts import case_contracts

    raw = got.meta.get("memory")
    if raw is None or not case_contracts(case, got).memory:
        return None
    b = budget(case, got)
    where = " (on the CPU: offloaded)" if getattr(case, "offload", False) else ""
    return (
        f"per rank {b.sharded:,} B params + {b.grads:,} B grads + {b.optim:,} B optimizer state{where} as sharded"
        f" over {b.shard} ranks{TP_SHARES if getattr(case, 'tp', 1) > 1 else ''}:"
        f" {b.single_device(case) / b.per_rank:.2f}x less than on one device;"
        " nothing unsharded left after resharding"
    )
