"""Communication contract: each rank's collectives (verify/probes/comm.py) against the volume the
Case implies for FSDP2 (seed 001), per unit, step and micro-batch:

| phase    | collective     | dtype                         | group    | bytes (unsharded side)       |
|----------|----------------|-------------------------------|----------|------------------------------|
| forward  | all_gather     | param_dtype                   | S        | S x sum of padded shards      |
| backward | all_gather     | param_dtype, if resharded and | S, or k  | as forward                   |
|          |                | backward reaches the unit     |          |                              |
| backward | reduce_scatter | reduce_dtype (else param's)   | S        | S x padded shards with grads |
| backward | all_reduce     | reduce_dtype, 2-D mesh only   | R        | padded shards with grads     |
| clip     | all_reduce     | fp32                          | S        | 4 B x parameters with grads  |
| forward  | all_reduce     | int64, grouped experts with   | W        | 8 B x experts                |
|          |                | a load-balancing loss         |          |                              |

S is the shard group (the mesh's last dimension), R the replicas (HSDP's first), k an int
`reshard_after_forward` (1 means False, S means True). A parameter's shard is dim 0 padded up to
a multiple of S, cut in S rows (FSDP2's Shard(0)); a unit's collective carries all its
parameters at once. The backward all-gather is absent for a unit kept unsharded after forward;
the reduce-scatter (and HSDP all-reduce) happens on every micro-batch when syncing every
micro-batch, else on the last only; under `replica_sync_last` (HSDP's `set_requires_all_reduce(False)`
before all but the last micro-batch) the all-reduce on the last only. Under `shard_placement`
a Shard(1) parameter's shard is its dim-1 chunk, numel / S (even by construction). Under
`reshard_after_backward_last` (`set_reshard_after_backward(False)` before all but the last
micro-batch) a unit unsharded when a non-last micro-batch's backward ends stays so, and the next
micro-batch's forward all-gathers nothing for it (`FSDPParamGroup.unshard` returns on
`is_unsharded`): the units whose own pre-backward hook unsharded them, or, kept unsharded after
forward (reshard_after_forward False or 1), every unit (`held_after_backward`). A unit no
backward runs through is all-gathered again, even when the implicit prefetch gathered it in
backward (never copied out); under an int k it is still in its post-forward shards, so over k
ranks, not S (measured, torch 2.13: tests/test_fsdp2_knobs.py, the frozen embedding).

Degenerate meshes, as torch 2.13 issues them (measured with the probe; `FSDPParamGroup.unshard`
and `foreach_reduce`): at S = 1 ((W, 1), world size 1) no all-gather or reduce-scatter: both
test the shard group's size and copy locally. The all-reduce is decided by the mesh's shape,
not by R: a 2-D mesh makes an HSDPMeshInfo, whose replicate group `foreach_reduce` all-reduces
over whatever its size, so (1, W) and (1, 1) issue an all-reduce over one rank per unit (a
no-op in values, still a call) and a 1-D mesh none; that one-rank call is optional (a framework
builds (1, S) as a 1-D mesh: torchtitan's ParallelDims with dp_replicate 1). The clip's all-reduce is what
`clip_grad_norm_` on DTensors does in torch 2.13: the per-parameter norms, stacked (seed 001
pictures one scalar), partial over the shard dimension; DTensor skips it where S = 1.

Which units backward reaches (FSDP2's pre-backward unshard and its implicit prefetch,
`FSDPParamGroup.pre_backward` / `_backward_prefetch`): a unit's pre-backward hook is registered
on its forward outputs that require grad, so a unit no backward runs through (a frozen
embedding fed token ids; the memory contract's "no_backward", verify/probes/memory.py) is not
unsharded by its own hook. But each unit that is, prefetches the unit whose forward finished
just before its own (post-forward order, units with parameters only: one without has no
parameter group); so a no-backward unit is all-gathered in backward iff its successor in that
order is reached by backward (tests/regressions/3845c252c6e9.json: a frozen embedding before a
frozen norm), or, under activation checkpointing, iff it is nested in a checkpointed unit whose
backward runs, whose recompute runs its forward again (`recomputed_in_backward`; resharded only
at the end of backward). The prefetched gather's result is never copied out (the unit's own pre-backward,
which waits for it, never runs): bytes on the wire all the same; at S = 1, where the wait makes the
local copy, a package's casts before it are not made (`prefetched_only`).

These facts (the post-forward order, the units no backward runs through) are measured in the
first micro-batch of the run's first step (verify/probes/memory.py `forward_facts`), and the
expected collectives start there too (`Trace.first_step`): step 1, or k + 1 in a run resumed
after step k, whose module is as fresh as a new run's (built, sharded, loaded; FSDP2's lazy
init to come). Read at step 1, a resumed run had no facts at all, every unit counted as reached
by backward and held under `reshard_after_backward_last` (issue 37: a frozen unit's all-gather
in the next micro-batch "unexpected", at 1 to 4 ranks, HSDP, an int k); expected from step 1,
the steps a resumed run never ran became "none issued" findings, and one finding per unit, phase
and kind then hid the same finding at a step it ran (an fp32 all-gather under bf16 after a
resume went unreported). They hold until `unfreeze_step` (`unfrozen_at`): from then on every
unit takes its own backward.

Under `prefetch` (explicit lists, verify/engines/prefetch.py) a unit with a non-empty backward
list prefetches that list instead (`FSDPState._pre_backward`: the implicit prefetch only runs
when the list is empty, which is the last unit in backward order's case, with no predecessor).
The lists follow the reverse of the post-forward order, so a target's own backward has not run
yet and `unshard` (which returns while a gather is pending or the unit is unsharded) gathers each
unit once per pass: the forward and backward volumes are the table's. What changes is only which
no-backward unit is gathered: one in a list of a unit whose backward runs (k = 1 is the implicit
rule again; k = 2 also reaches a frozen embedding behind a frozen norm). Such a gather is never
copied out, and FSDP2's final backward callback discards it (`finalize_backward`), so the next
forward gathers the unit again, as without prefetching. Forward prefetching moves a gather
earlier where its lists follow the run order; where they do not, a list names a unit that has
already run (the lists follow registration order: the Transformer's SwiGLU registers `w2` before
the `w3` it runs after), and a unit resharded after its forward is gathered again there, the
gather pending into backward, whose pre-backward copies it out instead of gathering: one forward
gather more, one backward gather less (issue 48: "unexpected all_gather of 576 B", 4
micro-batches at 3 ranks, tests/regressions/f8b28b06ee82.json). So under `prefetch` the forward
is replayed in the measured run order (verify/checks/prefetch.py, `prefetched_forward`), and
its gathers and pending units are the contract's; the memory contract reads the same replay.
One exception, with activation checkpointing (measured, torch 2.13: a fresh-seed hunt's false
alarm, an MLP whose `layers.0` holds the units `layers.0.linear` and `layers.0.dropout`): a unit
nested in a non-root unit is recomputed when its outer unit's backward begins, before its own
pre-backward hook has set its state, so `FSDPState._pre_forward` takes the forward path (its
PRE_BACKWARD shortcut does not apply) and issues the unit's *forward* prefetch list again. A
target outside the outer unit has finished its backward by then and been resharded, so it is
all-gathered once more, over the full shard group, and never used (`finalize_backward`
discards it); targets inside the outer unit are merely gathered early
(`regathered_in_recompute`). Measured both ways, though: in a Transformer whose units nest three
deep (regression `fca52d9137dc`, four variants) FSDP2 issues no such gather, and when a recompute
re-issues the list is not modelled; so that all-gather is allowed, not required (`optional`): a
correct engine passes either way, and no bug of the zoo shows only there. Under `reshard_after_backward_last` a non-last micro-batch leaves
the target unsharded: nothing gathered.

Beside tensor parallelism (issue 39) the units' parameters are a tp rank's shares
(`params_by_unit`), each collective names the mesh dim its group spans (`over`: the tp group and
the shard group are often the same size), and the plan's own collectives over "tp" are expected
per layer (verify/checks/tp_comm.py: `tp_collectives`); where the plan cannot be derived (a
user's) the measured ones over tp are left out of the comparison (`comparable`), FSDP2's held.

Collectives of one kind, dtype and group in one window carry no unit name, so each measured one
is attributed to the unit whose expected bytes it equals (identical units are interchangeable).
What stays unmatched is a finding naming the unit and the collective: an all-reduce where a
reduce-scatter belongs (twice the traffic), an all-gather in fp32 under a bf16 policy.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace

from fsdp_verify import units
from fsdp_verify.case import Case
from fsdp_verify.checks.prefetch import ForwardPass
from fsdp_verify.compare.finding import Finding
from fsdp_verify.dims import registry
from fsdp_verify.dtypes import to_torch
from fsdp_verify.models import is_ignored
from fsdp_verify.probes.comm import padded_shard_numel
from fsdp_verify.trace import Trace
from fsdp_verify.units import owner_of_param as owning_unit

COMPARATOR = "CommContract"
PHASE_ORDER = {"forward": 0, "backward": 1, "clip": 2, "optimizer": 3}


@dataclass(frozen=True)
class Collective:
    step: int
    microbatch: int
    phase: str
    kind: str
    dtype: str
    group: int
    bytes: int
    unit: str = ""  # "" unattributed (measured); "<root>" is the root unit
    # Allowed, not required: matched only by an equal measured collective, never missed
    # (a checkpointed recompute's re-issued prefetch, `regathered_in_recompute`).
    optional: bool = False
    # The mesh dim the group spans ("tp", "shard", "replicate"), in a tp case only: the tp group
    # and the shard group are often the same size (verify/probes/comm.py).
    over: str = ""

    @property
    def traffic(self) -> tuple:
        """Everything but the unit: what a measured collective (which names none) must equal."""
        return (self.step, self.microbatch, self.phase, self.kind, self.dtype, self.group, self.bytes, self.over)

    @property
    def window(self) -> tuple[int, int, int]:
        return (self.step, self.microbatch, PHASE_ORDER.get(self.phase, 9))

    def describe(self) -> str:
        over = f" ({self.over})" if self.over else ""
        return f"{self.kind} {self.dtype} of {self.bytes:,} B over {self.group} ranks{over}"


def _size(dtype: str) -> int:
    """Bytes an element: the policy's names ("bf16"), or torch's ("float8_e4m3fn")."""
    import torch

    if dtype in ("fp32", "bf16", "fp16"):
        return torch.empty((), dtype=to_torch(dtype)).element_size()
    return getattr(torch, dtype).itemsize


def params_by_unit(case: Case, got: Trace) -> dict[str, list[tuple[str, list[int]]]]:
    """Unit -> (parameter, shape FSDP2 shards) in model order, from the model as rank 0 built it;
    the `ignored` parameters left out (FSDP2 manages none of them: `ignored_params`). Under tensor
    parallelism the shape is a tp rank's (the plan's split dim divided by tp: FSDP2 shards the
    local tensor, `_StridedShard`)."""
    from fsdp_verify.checks.tp_comm import local_shape

    split = tp_split(case)
    tp = case.parallel.tp
    units: dict[str, list[tuple[str, list[int]]]] = {u: [] for u in case.wrap_plan}
    for name, shape, *_ in got.meta.get("build", [[]])[0]:
        if not is_ignored(getattr(case, "ignored", ()), name):
            units[owning_unit(case.wrap_plan, name)].append((name, local_shape(shape, split.get(name), tp)))
    return units


def tp_split(case: Case) -> dict[str, int]:
    """The parameters the tp plan splits, with their dim (none without tp)."""
    if case.parallel.tp <= 1:
        return {}
    from fsdp_verify.engines.tensor_parallel import split_parameters

    return split_parameters(case)


def ignored_params(case: Case, got: Trace) -> list[tuple[str, list[int]]]:
    """The `ignored` parameters (name, full shape), in model order: held whole on every rank."""
    ignored = getattr(case, "ignored", ())
    return [(n, list(shape)) for n, shape, *_ in got.meta.get("build", [[]])[0] if is_ignored(ignored, n)]


def placement_dims(case: Case, units: dict[str, list[tuple[str, list[int]]]]) -> dict[str, int]:
    """Parameter -> the tensor dim FSDP2 shards it on (`shard_placement`: Shard(1) moves the
    padding from dim 0 to an even dim-1 split, so a shard's size; verify/engines/placement.py)."""
    from fsdp_verify.engines.placement import shard_dim

    rule = getattr(case, "shard_placement", "dim0")
    return {n: shard_dim(rule, n, s, case.mesh[-1]) for params in units.values() for n, s in params}


def unfrozen_at(case: Case, step: int) -> bool:
    """Whether `step` trains the frozen parameters (from `unfreeze_step` on): the units no backward
    ran through in the run's first step (`forward_facts`) all take one from then on."""
    return case.unfreeze_step is not None and step >= case.unfreeze_step


def backward_reached(
    units: dict[str, list[tuple[str, list[int]]]], got: Trace, case: Case | None = None, step: int = 1
) -> set[str]:
    """The units FSDP2 unshards in backward at `step`, if resharded after forward (see the module
    docstring): each unit whose output needs a gradient, and what such a unit prefetches: its
    explicit backward list under `prefetch`, else (an empty list) the one whose forward finished
    just before its own (the implicit prefetch). Every unit without the memory record, and from
    `unfreeze_step` on (the frozen units' own backward runs then: a frozen embedding unfrozen at
    step 2, its all-gather in backward "unexpected" there; found beside the fix of issue 37)."""
    from fsdp_verify.engines.prefetch import prefetch_lists
    from fsdp_verify.probes.memory import forward_facts

    facts = forward_facts(got)
    if facts is None or (case is not None and unfrozen_at(case, step)):
        return set(units)
    order, no_backward = facts
    grouped = [u for u in order if units.get(u)]  # FSDP2's post-forward order
    k = getattr(case, "prefetch", None) if case is not None else None
    lists: dict[str, list[str]] = {}
    if k is not None:
        names = [name for name, *_ in got.meta.get("build", [[]])[0]]
        lists = {u: bwd for u, (_fwd, bwd) in prefetch_lists(case.wrap_plan, names, k, case.ignored).items()}
    implicit = dict(zip(grouped[1:], grouped))  # a unit -> the one whose forward finished before
    own = [u for u in grouped if u not in no_backward]
    prefetched = set()
    for u in own:
        prefetched |= set(lists[u]) if lists.get(u) else {implicit[u]} if u in implicit else set()
    unreached = {u for u in grouped if u in no_backward} - prefetched - recomputed_in_backward(case, no_backward)
    return set(units) - unreached


def prefetched_only(units: dict[str, list[tuple[str, list[int]]]], got: Trace, case: Case, step: int = 1) -> set[str]:
    """The units backward reaches only by another unit's prefetch (`backward_reached`): no
    backward runs through them, nor a recompute of their forward, so nothing waits on the
    all-gather issued for them (`FSDPParamGroup.wait_for_unshard` never runs). At S = 1 that
    matters: `unshard` gathers nothing there and the local copy, with a package's casts before
    it (float8's `fsdp_pre_all_gather` and its amax all-reduce), happens in the wait, so these
    units cast nothing in backward (measured, torch 2.13 and torchao 0.18: the CI's fresh-seed
    false alarm, tests/regressions/c383cd01906a.json, a frozen first layer at world size 1).
    Over S > 1 the gather runs and its metadata stays on the unit's parameters until its next
    copy-out (verify/checks/memory.py)."""
    from fsdp_verify.probes.memory import forward_facts

    facts = forward_facts(got)
    if facts is None or unfrozen_at(case, step):
        return set()
    no_backward = facts[1]
    reached = backward_reached(units, got, case, step)
    return (reached & no_backward) - recomputed_in_backward(case, no_backward)


def recomputed_in_backward(case: Case | None, no_backward: set[str]) -> set[str]:
    """Under activation checkpointing, the units no backward runs through whose forward runs
    again in backward all the same: nested in a checkpointed unit (every non-root unit of the
    plan) whose own backward runs, whose recompute re-runs their forward. FSDP2 unshards them
    there (`FSDPState._pre_forward`: their state is not PRE_BACKWARD) and copies them out, and
    their post-forward, inside backward, does not reshard (`FSDPParamGroup.post_forward`: `if
    not is_bw()`): they are all-gathered in backward (once: a pending prefetch or an unsharded
    unit is not gathered again), over the post-forward group under an int k, and only the final
    callback's post-backward reshards them, so a backward that does not reshard
    (`reshard_after_backward_last`) leaves them unsharded into the next micro-batch. Measured,
    torch 2.13: a fresh-seed hunt's false alarm (issue 37, seed 20270104, a frozen embedding and
    attention norm, the norm nested in the checkpointed `layers.0`), and a frozen chain of three
    nested units gathered in backward at 2 and 4 ranks, k = 2 (tests/test_contracts.py)."""
    if case is None or not case.activation_checkpointing:
        return set()
    checkpointed = [a for a in case.wrap_plan if a and a not in no_backward]
    return {u for u in no_backward if any(u.startswith(a + ".") for a in checkpointed)}


def reduced_again(case: Case, unit: str) -> bool:
    """Whether FSDP2 may reduce `unit`'s gradients a second time in a step: a unit over several
    modules, under activation checkpointing, with `set_reduce_scatter_unused_params(True)` (which
    the toolkit's FSDP2 sets for a model with routed experts: verify/engines/spec.py). Measured
    with plain torch 2.13 (tests/upstream/test_fsdp2_unused_params_group_reduced_twice.py): where
    a member of such a group does not run in forward (the MLP's last block skips its dropout) and
    the units nest as the MLP's `layers.i` and their children do, the root's post-backward
    callback finds a param group not in POST_BACKWARD and runs its post-backward again, one more
    reduce-scatter (and all-reduce under HSDP) of zeros: the gradients agree, the traffic is
    wasted (fuzz seed 4931's false alarm, tests/regressions/7b220140646b.json). Which layouts
    trigger it was not narrowed further (four of six plans tried did not), so the second
    reduction is allowed, never required, for every such group; a double reduction that changes
    the gradients is still caught by them."""
    return units.is_group(unit) and bool(case.activation_checkpointing) and bool(case.model.experts)


def regathered_in_recompute(case: Case, units: dict[str, list[tuple[str, list[int]]]], got: Trace) -> set[str]:
    """Under `prefetch` with activation checkpointing, the units all-gathered a second time in
    backward (see the module docstring): the forward-list targets of a unit nested in a
    non-root unit that lie outside that outer unit (their backward is over when it recomputes).
    No-backward targets are left out (a pending prefetch or none: not measured)."""
    from fsdp_verify.engines.prefetch import prefetch_lists
    from fsdp_verify.probes.memory import forward_facts

    if getattr(case, "prefetch", None) is None or not case.activation_checkpointing:
        return set()
    facts = forward_facts(got)
    names = [name for name, *_ in got.meta.get("build", [[]])[0]]
    out: set[str] = set()
    for unit, (fwd, _bwd) in prefetch_lists(case.wrap_plan, names, case.prefetch, case.ignored).items():
        outer = [a for a in case.wrap_plan if a and unit.startswith(a + ".")]
        if outer:
            a = min(outer, key=len)
            out |= {t for t in fwd if not t.startswith(a + ".")}
    return out - (facts[1] if facts else set())


def regathered_out_of_order(case: Case, units: dict[str, list[tuple[str, list[int]]]], got: Trace) -> set[str]:
    """Under `prefetch`, the units a backward list names after their own backward has run, as
    the modules ran (the measured post-forward order, reversed) rather than as they are
    registered (the lists' order): gathered again, from their full shards, and discarded (a
    fresh-seed sweep's false alarm, seed 20263711: an MLP whose `moe` is registered after the
    layers but runs before them, 1,188 B)."""
    from fsdp_verify.engines.prefetch import prefetch_lists
    from fsdp_verify.probes.memory import forward_facts

    facts = forward_facts(got)
    if getattr(case, "prefetch", None) is None or facts is None:
        return set()
    order, no_backward = facts
    grouped = [u for u in order if units.get(u)]
    names = [name for name, *_ in got.meta.get("build", [[]])[0]]
    lists = {u: bwd for u, (_fwd, bwd) in prefetch_lists(case.wrap_plan, names, case.prefetch, case.ignored).items()}
    implicit = dict(zip(grouped[1:], grouped))
    done: set[str] = set()
    out: set[str] = set()
    for u in reversed(grouped):
        if u in no_backward:
            continue
        targets = lists.get(u) or ([implicit[u]] if u in implicit else [])
        out |= {t for t in targets if t in done}
        done.add(u)
    return out


def held_after_backward(
    case: Case, units: dict[str, list[tuple[str, list[int]]]], got: Trace, step: int = 1
) -> set[str]:
    """Under `reshard_after_backward_last`, the units a non-last micro-batch's backward of `step`
    leaves unsharded (see the module docstring): every unit if none is resharded after forward,
    else each unit no backward skips (without the memory record: every unit). From
    `unfreeze_step` on, the frozen units train, so backward runs through every unit (a fresh-seed
    sweep's false alarm, seed 20262834: a frozen embedding unfrozen at step 2, held there). A unit
    no backward runs through is held too when a checkpointed recompute ran its forward
    (`recomputed_in_backward`)."""
    from fsdp_verify.probes.memory import forward_facts

    facts = forward_facts(got)
    if facts is None or unfrozen_at(case, step):
        return set(units)
    # a unit kept unsharded after forward (False, or an int 1) is held whatever backward does
    kept = {u for u, rsf in unit_reshards(case, got).items() if rsf is False or (rsf is not True and rsf == 1)}
    return (set(units) - facts[1]) | recomputed_in_backward(case, facts[1]) | (kept & set(units))


def unit_reshards(case: Case, got: Trace) -> dict[str, bool | int]:
    """Each unit's `reshard_after_forward`: as the engine built it (FSDP2's states, recorded by
    the loop: verify/engines/fsdp2_ownership.py `built_reshards`), where recorded, else the
    case's. A framework sets it per unit: torchtitan reshards its blocks, not its `[norm,
    lm_head]`, and leaves the root to FSDP2's default (no reshard); the contracts model each
    unit by its own."""
    from fsdp_verify.engines.fsdp2_ownership import BUILT_RESHARDS

    built = got.meta.get(BUILT_RESHARDS) or {}
    return {u: built.get(u, case.reshard_after_forward) for u in case.wrap_plan}


def backward_group_of(rsf: bool | int, shard: int) -> int | None:
    """Over how many ranks a unit is all-gathered again in backward: the shard group where it was
    resharded after forward, its post-forward group under an int, none where it was kept."""
    if rsf is True or rsf == shard:
        return shard
    if rsf is False or rsf == 1:  # an int 1 reshards to one rank: nothing to gather (FSDP2)
        return None
    return int(rsf)


def expected_collectives(case: Case, got: Trace) -> list[Collective]:
    """What FSDP2 issues for this case on every rank (see the table above)."""
    replicas, shard = (case.mesh[0], case.mesh[1]) if len(case.mesh) == 2 else (1, case.mesh[0])
    hsdp = len(case.mesh) == 2  # FSDP2's HSDPMeshInfo: an all-reduce even over one replica
    param_dtype = case.precision.param_dtype or "fp32"
    reduce_dtype = case.precision.reduce_dtype or param_dtype
    backward_groups = {u: backward_group_of(rsf, shard) for u, rsf in unit_reshards(case, got).items()}
    tp = case.parallel.tp > 1
    # the groups' mesh dims, in a tp case (a group of one rank is named by none: verify/probes/comm.py)
    on = {d: (d if tp and size > 1 else "") for d, size in (("shard", shard), ("replicate", replicas))}
    units = params_by_unit(case, got)
    dims = placement_dims(case, units)
    recomputed = regathered_in_recompute(case, units, got)
    out_of_order = regathered_out_of_order(case, units, got)
    regathered = recomputed | out_of_order
    out: list[Collective] = []
    # The steps this run trained: a run resumed after step k starts at k + 1. Expected from step
    # 1, the steps it never ran were "none issued" findings, and `check_comm`'s one finding per
    # unit, phase and kind kept those and dropped the same finding at a step it ran (the resume
    # then dropped the early ones: a real finding after a resume was never shown; issue 37).
    for step in range(got.first_step, case.steps + 1):
        with_grad = {n for s, phase, n in got.records if s == step and phase == "grads"}
        reached = backward_reached(units, got, case, step)
        unwaited = prefetched_only(units, got, case, step) if shard == 1 else set()
        # each unit's all-gather: its dtype, bytes, and what a package casts before one (per step:
        # float8's precomputed scales start after the first)
        traffic = {
            u: _all_gather_traffic(case, got, p, dims, shard, param_dtype, step == got.first_step)
            for u, p in units.items()
        }
        for m in range(case.microbatches):
            last = m == case.microbatches - 1
            synced = case.sync_every_microbatch or last
            # replica_sync_last: the replicas' all-reduce only on the last micro-batch
            replicas_synced = synced and (last or not getattr(case, "replica_sync_last", False))
            # reshard_after_backward_last: the units the previous micro-batch's backward left unsharded
            kept = m > 0 and getattr(case, "reshard_after_backward_last", False)
            held = held_after_backward(case, units, got, step) if kept else set()
            # under `prefetch`, FSDP2's forward replayed in run order (verify/checks/prefetch.py):
            # which units its forward gathers, over which group, and which gathers stay pending
            # into backward (a unit whose own pre-backward then copies out the forward's gather)
            int_kept = kept and any(g not in (None, shard) for g in backward_groups.values())
            fp = prefetched_forward(case, units, got, held, int_kept)
            for unit, params in units.items():
                name = unit or "<root>"
                backward_group = backward_groups.get(unit)
                # a unit left in its post-forward shards (int k) is gathered over k
                start = backward_group if kept and backward_group else shard
                shards = sum(padded_shard_numel(s, shard, dims[n]) for n, s in params)
                grad_shards = sum(padded_shard_numel(s, shard, dims[n]) for n, s in params if n in with_grad)
                gather_dtype, gathered, casts = traffic[unit]
                if shards and (shard > 1 or casts):  # at S = 1 no all-gather, a package's casts still
                    if fp is not None and unit in fp.ran and shard > 1:  # at S = 1 no gathers to replay
                        groups = [g for u, g in fp.run.gathers if u == unit]
                    else:
                        groups = [] if unit in held else [start]
                    for group in groups:
                        fwd = Collective(step, m, "forward", "all_gather", gather_dtype, group, gathered, name)
                        out += _gather(fwd, casts, shard, on["shard"])
                    moved = fp is not None and unit in fp.run.pending  # gathered in forward already
                    if backward_group is not None and unit in reached and not moved:
                        bwd = Collective(
                            step, m, "backward", "all_gather", gather_dtype, backward_group, gathered, name
                        )
                        out += _gather(bwd, [] if unit in unwaited else casts, shard, on["shard"])
                    # prefetch under checkpointing: gathered again, from its full shards, unless
                    # this backward keeps it unsharded (reshard_after_backward_last)
                    keeps = not last and getattr(case, "reshard_after_backward_last", False)
                    if unit in regathered and not keeps:
                        # a recompute's re-issued forward list only allows it (`regathered_in_recompute`)
                        optional = unit in recomputed and unit not in out_of_order
                        again = Collective(step, m, "backward", "all_gather", gather_dtype, shard, gathered, name)
                        out += _gather(replace(again, optional=optional), casts, shard, on["shard"])
                again = reduced_again(case, unit)
                if synced and grad_shards and shard > 1:
                    rs = shard * grad_shards * _size(reduce_dtype)
                    rsc = Collective(step, m, "backward", "reduce_scatter", reduce_dtype, shard, rs, name)
                    out.append(replace(rsc, over=on["shard"]))
                    if again:
                        out.append(replace(rsc, over=on["shard"], optional=True))
                if replicas_synced and grad_shards and hsdp:
                    ar = grad_shards * _size(reduce_dtype)
                    arc = Collective(step, m, "backward", "all_reduce", reduce_dtype, replicas, ar, name)
                    # over one replica the call moves nothing: FSDP2 on a (1, S) mesh issues it, an
                    # engine that builds that case as plain FSDP over S (torchtitan: dp_replicate 1
                    # makes a 1-D mesh) does not; either is the same training
                    out.append(replace(arc, over=on["replicate"], optional=replicas == 1))
                    if again:
                        out.append(replace(arc, over=on["replicate"], optional=True))
        out += _routing_counts(case, step)
        if case.world_size > 1:  # the loop's all-reduce of each ignored gradient, after the last backward
            for n, shape in ignored_params(case, got):
                if n in with_grad:
                    numel = padded_shard_numel(shape, 1)
                    m = case.microbatches - 1
                    out.append(Collective(step, m, "backward", "all_reduce", "fp32", case.world_size, 4 * numel, n))
        out += tp_collectives(case, got, step, with_grad)
        out += _clip_collectives(case, step, with_grad, shard, on["shard"])
    return out


def _gather(all_gather: Collective, casts: list[tuple[str, str, int]], shard: int, over: str) -> list[Collective]:
    """One all-gather of a unit, and what a package casts before one from the unit's full shards
    (float8's amax all-reduces, over the shard group)."""
    out = [replace(all_gather, over=over)] if shard > 1 else []
    if all_gather.group == shard:
        out += [replace(all_gather, kind=k, dtype=d, bytes=b, over=over) for k, d, b in casts]
    return out


def _all_gather_traffic(
    case: Case,
    got: Trace,
    params: list[tuple[str, list[int]]],
    dims: dict[str, int],
    shard: int,
    param_dtype: str,
    first: bool,
) -> tuple[str, int, list[tuple[str, str, int]]]:
    """A unit's all-gather: its dtype, bytes, and the collectives before one from full shards. Each
    parameter goes in `param_dtype`, unless a dimension package says otherwise (float8's weights
    as float8: verify/dims/registry.py `contributions`); inputs of several dtypes FSDP2 gathers as
    uint8 bytes (`_get_all_gather_input_metadatas`)."""
    dtypes: dict[str, str] = {}
    casts: list[tuple[str, str, int]] = []
    for overrides, before in registry.contributions(case, got, "all_gather", params, first):
        dtypes.update(overrides)
        casts += before
    per_rank = sum(padded_shard_numel(s, shard, dims[n]) * _size(dtypes.get(n, param_dtype)) for n, s in params)
    kinds = {dtypes.get(n, param_dtype) for n, _ in params}
    return (kinds.pop() if len(kinds) == 1 else "uint8"), shard * per_rank, casts


def _clip_collectives(case: Case, step: int, with_grad: set[str], shard: int, over: str) -> list[Collective]:
    """The clip's all-reduces: each group of gradients on one mesh (`EngineView.clip_grad_norm_`;
    two beside tp where the plan leaves parameters off its mesh), in the order its first
    parameter comes, makes its stacked norms whole over the shard group (one fp32 each) and, where
    some gradient of it is split over tp, over tp after."""
    import fsdp_verify.checks.tp_comm as tp_comm

    if case.clip_norm is None or not with_grad:
        return []
    out = []
    for group in tp_comm.clip_groups(case, with_grad):
        if shard > 1:
            out.append(
                Collective(step, 0, "clip", "all_reduce", "fp32", shard, 4 * len(group), "<all units>", over=over)
            )
        if case.parallel.tp > 1 and not tp_comm.underivable(case) and tp_comm.clip_over_tp(case, group):
            out.append(
                Collective(step, 0, "clip", "all_reduce", "fp32", case.tp, 4 * len(group), "<all units>", over="tp")
            )
    return out


@dataclass(frozen=True)
class Replayed:
    """A forward replayed (`prefetched_forward`) and the units it covers (those that ran)."""

    run: ForwardPass
    ran: frozenset[str]


def prefetched_forward(
    case: Case, units: dict[str, list[tuple[str, list[int]]]], got: Trace, held: set[str], from_post_forward: bool
) -> Replayed | None:
    """Under `prefetch`, one micro-batch's forward as FSDP2 runs it (verify/checks/prefetch.py):
    the forward lists acted on in the measured run order, so a list naming a unit that has
    already run (registration order is not run order: the Transformer's `w2` before `w3`)
    gathers it again where it was resharded, and that gather is backward's. `held`: the units
    still unsharded from the previous backward; `from_post_forward`: the others start in their
    post-forward shards (int k, `reshard_after_backward_last`). None without `prefetch` or
    without the memory record's run order (the table's rule then)."""
    from fsdp_verify.checks.prefetch import forward_pass
    from fsdp_verify.engines.prefetch import prefetch_lists
    from fsdp_verify.probes.memory import forward_facts

    facts = forward_facts(got)
    if getattr(case, "prefetch", None) is None or facts is None:
        return None
    order = facts[0]
    grouped = {u for u, params in units.items() if params}
    names = [name for name, *_ in got.meta.get("build", [[]])[0]]
    lists = {u: fwd for u, (fwd, _bwd) in prefetch_lists(case.wrap_plan, names, case.prefetch, case.ignored).items()}
    shard = case.mesh[-1]
    start = frozenset(grouped - held) if from_post_forward else frozenset()
    run = forward_pass(order, grouped, lists, shard, case.reshard_after_forward, frozenset(held), start)
    return Replayed(run, frozenset(order))


def recomputed_units(case: Case, got: Trace, step: int) -> set[str]:
    """Under activation checkpointing, the checkpointed units (every unit but the root) whose
    forward runs again in backward: those backward runs through (`forward_facts`; every unit
    without the record, or from `unfreeze_step` on)."""
    from fsdp_verify.probes.memory import forward_facts

    if not case.activation_checkpointing:
        return set()
    units = {u for u in case.wrap_plan if u}
    facts = forward_facts(got)
    if facts is None or unfrozen_at(case, step):
        return units
    return units - facts[1]


def tp_collectives(case: Case, got: Trace, step: int, with_grad: set[str]) -> list[Collective]:
    """Tensor parallelism's own collectives of `step` over the tp group, per layer
    (verify/checks/tp_comm.py; the clip's all-reduce over tp: `_clip_collectives`); none without tp or where the
    case's plan cannot be derived (`tp_comm.underivable`: the measured ones over tp are not
    compared there, `comparable`)."""
    import fsdp_verify.checks.tp_comm as tp_comm

    if case.parallel.tp <= 1 or tp_comm.underivable(case):
        return []
    tp = case.tp

    def collective(step, m, phase, kind, dtype, size, unit, optional=False):
        return Collective(step, m, phase, kind, dtype, tp, size, unit, optional, over="tp")

    return tp_comm.expected_tp(case, step, with_grad, recomputed_units(case, got, step), collective)


def comparable(case: Case, measured: list[Collective]) -> list[Collective]:
    """The measured collectives the contract holds: all, but those over tp where the case's tp
    plan cannot be derived (`tp_comm.underivable`)."""
    import fsdp_verify.checks.tp_comm as tp_comm

    if case.parallel.tp > 1 and tp_comm.underivable(case):
        return [c for c in measured if c.over != "tp"]
    return measured


def _routing_counts(case: Case, step: int) -> list[Collective]:
    """A load-balancing loss's forward all-reduce of the grouped experts' counts over every rank
    (int64, one per expert: verify/models/moe.py), each micro-batch; once more in backward where
    activation checkpointing recomputes the `moe` unit's forward. (Its router bias's all-reduce
    runs after the optimizer step, outside the measured windows.)"""
    model = case.model
    if not (model.grouped_experts and model.aux_loss) or case.world_size == 1:
        return []
    counts = 8 * model.experts
    recomputed = case.activation_checkpointing and "moe" in case.wrap_plan
    out = []
    for m in range(case.microbatches):
        for phase in ("forward", "backward") if recomputed else ("forward",):
            out.append(Collective(step, m, phase, "all_reduce", "int64", case.world_size, counts, "moe:counts"))
    return out


def measured_collectives(got: Trace) -> list[list[Collective]] | None:
    raw = got.meta.get("comm")
    if raw is None:
        return None
    return [[Collective(*rec[:7], over=rec[7] if len(rec) > 7 else "") for rec in records] for records in raw["ranks"]]


@dataclass
class Row:
    """One expected collective and what was measured for it (or a measured one nobody expected)."""

    expected: Collective | None
    measured: Collective | None

    @property
    def ok(self) -> bool:
        return (
            self.expected is not None and self.measured is not None and self.expected.traffic == self.measured.traffic
        )

    @property
    def unit(self) -> str:
        return self.expected.unit if self.expected else "?"


def match(expected: list[Collective], measured: list[Collective]) -> list[Row]:
    """Pair each measured collective with an expected one: first equal in everything but the
    unit (same window), then what is left in a window, in order of size (the differing pairs),
    then the unpaired on either side."""
    by_window: dict[tuple, tuple[list[Collective], list[Collective]]] = defaultdict(lambda: ([], []))
    for e in expected:
        by_window[e.window][0].append(e)
    for g in measured:
        by_window[g.window][1].append(g)
    rows: list[Row] = []
    for window in sorted(by_window):
        want, got = by_window[window]
        left = list(got)
        pending: list[Collective] = []
        for e in sorted(want, key=lambda c: c.optional):  # the required first: an optional twin takes what is left
            twin = next((g for g in left if g.traffic == e.traffic), None)
            if twin is None:
                pending.append(e)
            else:
                left.remove(twin)
                rows.append(Row(e, twin))
        pending = [e for e in pending if not e.optional]
        pending.sort(key=lambda c: (-c.bytes, c.kind))
        left.sort(key=lambda c: (-c.bytes, c.kind))
        for i in range(max(len(pending), len(left))):
            rows.append(Row(pending[i] if i < len(pending) else None, left[i] if i < len(left) else None))
    return rows


def check_comm(case: Case, ref: Trace, got: Trace) -> list[Finding]:
    from fsdp_verify.engines.contracts import as_run, case_contracts

    if not case_contracts(case, got).comm:
        return []
    case = as_run(case, got)
    ranks = measured_collectives(got)
    if ranks is None:
        return [_finding(0, "<probe>", "the sharded trace holds no communication record (was the CommProbe run?)")]
    expected = expected_collectives(case, got)
    findings: list[Finding] = []
    reported: set[tuple[str, str, str]] = set()
    for rank, measured in enumerate(ranks):
        for row in match(expected, comparable(case, measured)):
            if row.ok:
                continue
            e, g = row.expected, row.measured
            key = (row.unit, (e or g).phase, (e or g).kind)
            if key in reported:
                continue
            reported.add(key)
            where = (e or g).window
            text = f"rank {rank}, micro-batch {where[1]}, {(e or g).phase}: "
            if e is not None and g is not None:
                text += f"unit {e.unit!r}: {g.describe()}, the model says {e.describe()}"
            elif e is not None:
                text += f"unit {e.unit!r}: expected {e.describe()}, none issued"
            else:
                text += f"unexpected {g.describe()} ({alike(expected, g)})"
            name = f"{row.unit}:{(e or g).phase}:{(e or g).kind}"
            findings.append(_finding((e or g).step, name, text))
    return findings


def alike(expected: list[Collective], g: Collective) -> str:
    """What the model says of a collective no unit accounts for: the units expected to issue one
    of the same traffic in its window (a layer's collective issued more often than its style
    says: `Collective` carries no unit name, so the candidates are named), or none."""
    twins = sorted({e.unit for e in expected if e.traffic == g.traffic})
    if not twins:
        return "no unit of the plan accounts for it"
    return f"one more than the model says; it expects one such from each of {', '.join(map(repr, twins))}"


def _finding(step: int, name: str, message: str) -> Finding:
    return Finding(step, "comm", name, False, "contract", COMPARATOR, message)


def comm_summary(case: Case, ref: Trace, got: Trace) -> str | None:
    from fsdp_verify.engines.contracts import as_run, case_contracts

    contracts = case_contracts(case, got)
    if not contracts.comm:
        return None
    case = as_run(case, got)
    ranks = measured_collectives(got)
    if ranks is None:
        return None
    import fsdp_verify.checks.tp_comm as tp_comm

    expected = expected_collectives(case, got)
    total = sum(c.bytes for c in ranks[0])
    summary = f"{len(expected)} collectives per rank as FSDP2's model implies"
    if case.parallel.tp > 1:
        why = tp_comm.underivable(case)
        tp = sum(c.over == "tp" for c in expected)
        summary += f" ({tp} of them the tp plan's, per layer)" if not why else f" (over tp: n/a, {why})"
    return f"{summary}, {total:,} B on rank 0 (kind, dtype, group, bytes)"
