"""Turn a first divergence into a likely cause, from the shape of the difference."""

from __future__ import annotations

import torch

from fsdp_verify import evidence
from fsdp_verify.case import Case
from fsdp_verify.compare.finding import Finding
from fsdp_verify.dtypes import to_torch
from fsdp_verify.sharded.collect import rank_rows
from fsdp_verify.trace import Key, Trace
from fsdp_verify.training.resume import FRESH_PARAM_GROUPS

# Precision-contract findings are named "<stage>:<name>" (verify/checks/precision.py).
_PRECISION_HINTS = {
    "sharded": (
        "the sharded parameters (the master weights) are held in {got}, not fp32: the model was cast"
        " (model.to({got})) before sharding, or the engine shards low-precision copies. Keep master"
        " weights, gradients and optimizer state fp32 and let param_dtype cast the unsharded copies"
        " (seed 000)"
    ),
    "reduce": (
        "gradients are reduced in {got}, not the policy's reduce_dtype: the reduce_dtype never reached"
        " the engine, or it casts before the collective (seed 000: bf16 reductions lose small contributions)"
    ),
    "forward_params": (
        "forward ran with {got} parameters, not param_dtype: the MixedPrecisionPolicy never reached"
        " the engine's all-gather (seed 000)"
    ),
    "backward_grads": "backward computed gradients in {got}, not param_dtype: the policy is not applied in backward",
    "grads": "the reduced gradients are held in {got}, not fp32: they must be cast back to the master weights' dtype",
    "optim_state": "the optimizer state is held in {got}, not fp32: the optimizer was built on low-precision parameters",
    "outputs": "unit outputs are {got}, not the policy's output_dtype",
    "forward_inputs": "unit inputs reached the forward in {got}, not param_dtype: cast_forward_inputs was not applied",
}


def precision_hint(first: Finding, got: Trace) -> str:
    """The hint for a broken precision contract, naming the dtype the probe saw."""
    stage, _, name = first.name.partition(":")
    steps = got.meta.get("precision", {}).get("steps", {})
    seen = steps.get(str(first.step), {}).get(stage, {}).get(name, [])
    template = _PRECISION_HINTS.get(stage)
    return template.format(got=" and ".join(seen) or "another dtype") if template else ""


def resume_hint(first: Finding, ref: Trace, got: Trace) -> str:
    """What a resume lost, named by the first record of the loaded state that is not the saved
    one (verify/training/resume.py lists what a checkpoint carries). The loaded parameters,
    optimizer state and param groups are tested against the records before a cause is named
    (`_loaded_state_hint`, `_param_group_hint`)."""
    name = first.name
    where = f"right after the resume's load (after step {first.step})"
    values = ""
    if first.kind == "deviation" and first.key in ref.records and ref.records[first.key].numel() <= 4:
        values = f": {got.records[first.key].tolist()}, saved {ref.records[first.key].tolist()}"
    if name == "data_position":
        return f"the data position is not the saved one {where}{values}: the data restarted, batches are seen twice"
    if name.startswith("loss_scale."):
        return f"the loss scaler's {name.split('.', 1)[1]} is not the saved one {where}{values}: the scaler was reset"
    if name == "rng":
        taken = evidence.generators_taken_from(ref, got, first.step)
        if taken:
            return (
                f"the generators of rank(s) {list(taken)} are not the ones they should resume with {where}, but those"
                f" the saving run's rank(s) {list(taken.values())} ended with: restored onto the wrong ranks (under"
                " tensor parallelism a rank resumes with its data-parallel rank's stream, rank // tp, which a change"
                " of the tp degree moves: not its own rank's)"
            )
        return f"the ranks' generators are not the saved ones {where}: the RNG state was not restored (dropout masks)"
    if name.startswith("schedule."):
        return (
            f"the lr schedule's position ({name.removeprefix('schedule.')}) is not the saved one {where}{values}:"
            " the scheduler was not restored (a fresh one restarts the schedule)"
        )
    if name.startswith("param_groups."):
        return _param_group_hint(first, ref, got, where)
    if name.startswith(("optim.", "params.")):
        return _loaded_state_hint(first, ref, got, where)
    return ""


def _param_group_hint(first: Finding, ref: Trace, got: Trace, where: str) -> str:
    """A hyperparameter of the loaded param groups: the saved value, the one the optimizer was
    built with (recorded before the load), or neither."""
    key = first.name.removeprefix("param_groups.")
    if first.kind != "deviation":
        return f"the param groups' {key} {where}: {first.message}"
    saved, loaded = ref.records[first.key].tolist(), got.records[first.key].tolist()
    built = got.meta.get(FRESH_PARAM_GROUPS, {}).get(first.name)
    text = f"the param groups' {key} is {loaded} {where}, not the saved {saved}"
    if built is None:
        return text
    if loaded == built:
        return (
            f"{text} but the value the optimizer was built with: the param groups were not loaded (the state"
            " alone, or a load that keeps the code's hyperparameters)"
        )
    return (
        f"{text} nor the {built} the optimizer was built with: set after the load (the loop applying its"
        " own optimizer settings to the loaded param groups?)"
    )


def _loaded_state_hint(first: Finding, ref: Trace, got: Trace, where: str) -> str:
    """A loaded parameter or optimizer state record that is not the saved one, tested in turn
    against: some ranks' shards right and others not; another record's saved value (swapped or
    mis-keyed); the saved rows in another order; the saved value at a lower precision's rounding; a fresh optimizer's (no state,
    zeros, a step count of 0); the parameter's initial value (its key not loaded). A cause is
    named only where one fits; otherwise the hint says what the value is not."""
    step, name = first.step, first.name
    optim = name.startswith("optim.")
    label = name.split(".", 1)[1]
    what = f"the optimizer state {label}" if optim else f"parameter {label}"
    if first.kind == "missing":
        if not optim:
            return f"{what} is missing {where}"
        held = [k for k in got.records if k[0] == step and k[1] == "resumed" and k[2].startswith("optim.")]
        if not held:
            return (
                f"the optimizer holds no state {where} (none for {label} or any other parameter), as a fresh"
                " optimizer before its first step: its state was never loaded"
            )
        return f"the optimizer holds no {label} {where}, though it holds state for others: that entry was not loaded"
    if first.kind != "deviation":
        return f"{what} {where}: {first.message}"
    saved, loaded = ref.records[first.key], got.records[first.key]
    differing = _differing(ref, got, step)
    apart = evidence.ranks_apart(ref, got, differing)
    if apart is not None and apart.right and apart.wrong:
        return _ranks_hint(ref, got, differing, (apart.right, apart.wrong), where[0].upper() + where[1:])
    saved_alike = {
        k[2]: t
        for k, t in ref.records.items()
        if k[0] == step and k[1] == "resumed" and k[2] != name and _same_kind(k[2], name)
    }
    others = evidence.equal_records(loaded, saved_alike)
    if others:
        other = others[0]
        back = got.records.get((step, "resumed", other))
        if back is not None and back.shape == saved.shape and torch.equal(back, saved):
            return (
                f"the loaded {label} is the saved {other.split('.', 1)[1]} and the loaded"
                f" {other.split('.', 1)[1]} is the saved {label} {where}: the two (same shape) were swapped,"
                " as when a state dict keyed by position is loaded into an optimizer or model that lists its"
                " parameters in another order"
            )
        return (
            f"the loaded {label} is the saved {other.split('.', 1)[1]} {where}: loaded under another"
            " parameter's name (mis-keyed state)"
        )
    # Chunks moved round whole (a shard a rank) first: the most specific reading of rows in another order.
    rotated = evidence.chunks_rotated(saved, loaded)
    if rotated is not None:
        dim, n, k = rotated
        return (
            f"the loaded {label} is the saved value with its {n} chunks along dim {dim} moved round by {k} (chunk i"
            f" holds the saved chunk i + {k}) {where}: its shards landed on other ranks (a load that maps shards or"
            " experts to ranks by their position in a group, not by their global offsets as DCP's reshard does?)"
        )
    order = evidence.rows_moved(saved, loaded)
    if order is not None:
        return (
            f"the loaded {label} holds the saved rows in another order {where} (row i holds saved row"
            f" {order}[i]): rows loaded into other rows' places, as when blocks of rows (experts, a rank's"
            " shard) saved under their local index are read back into another rank's slots"
        )
    dtype = evidence.rounded_through(saved, loaded)
    if dtype is not None:
        alike = sum(1 for k in differing if evidence.rounded_through(ref.records[k], got.records[k]) == dtype)
        return (
            f"the loaded {label} is the saved value rounded to {dtype} {where} (so are {alike} of the"
            f" {len(differing)} loaded records that differ): it was stored or passed in {dtype}, a lower precision"
            f" than its {str(saved.dtype).removeprefix('torch.')}"
        )
    if optim and name.endswith(".step") and not loaded.any():
        return f"Adam's step count is 0 {where}, saved {saved.tolist()}: reset on resume, its bias correction restarts"
    if optim and not loaded.any():
        return f"the loaded {label} is all zeros {where}, a fresh optimizer's value: its state was never loaded"
    initial = ref.records.get((0, "init", label))
    if not optim and initial is not None and initial.shape == loaded.shape and torch.equal(initial, loaded):
        return (
            f"parameter {label} holds its initial values {where}, on every rank: its key was not loaded"
            " (a key the load did not match, e.g. a wrapper's prefix, dropped by a non-strict load?)"
        )
    moved = int((saved != loaded).sum())
    tested = "another record's saved value, its rows in another order, the saved value rounded to bf16 or fp16, " + (
        "zeros" if optim else "its initial value"
    )
    return (
        f"{what} differs from the saved one {where} in {moved} of {saved.numel()} elements (max abs"
        f" {first.max_abs:.3g}); it is none of: {tested}"
    )


def _same_kind(other: str, name: str) -> bool:
    """Records a value may have been taken from by mistake: parameters for a parameter, the same
    state entry of another parameter for an optimizer state."""
    if name.startswith("params."):
        return other.startswith("params.")
    return other.startswith("optim.") and other.rsplit(".", 1)[1] == name.rsplit(".", 1)[1]


def _differing(ref: Trace, got: Trace, step: int) -> list[Key]:
    """The loaded parameters and optimizer state at `step` that are not the saved ones, bit for bit."""
    out = []
    for key, saved in ref.records.items():
        if key[0] != step or key[1] != "resumed" or not key[2].startswith(("optim.", "params.")):
            continue
        loaded = got.records.get(key)
        same_kind = loaded is not None and saved.shape == loaded.shape and saved.dtype == loaded.dtype
        if same_kind and not torch.equal(saved, loaded):
            out.append(key)
    return sorted(out)


def _ranks_hint(ref: Trace, got: Trace, differing: list[Key], split: tuple[list[int], list[int]], where: str) -> str:
    """Some ranks loaded the saved state, others hold something else: which, and what."""
    right, wrong = split
    text = f"{where} the shards of rank(s) {wrong} differ from the saved state and those of rank(s) {right} are the saved ones"
    params = [k for k in differing if k[2].startswith("params.")]
    if params and len(params) == len(differing) and all(_rows_initial(ref, got, k, wrong) for k in params):
        return (
            f"{text}: the parameters on rank(s) {wrong} are the freshly built model's (their initial values), so"
            f" the weights were loaded on rank(s) {right} only (an `if rank == 0` around the load?)"
        )
    names = ", ".join(k[2] for k in differing[:3]) + (", ..." if len(differing) > 3 else "")
    return f"{text} ({names})"


def _rows_initial(ref: Trace, got: Trace, key, ranks: list[int]) -> bool:
    """Whether the rows `ranks` hold of the loaded parameter `key` are its initial values."""
    initial = ref.records.get((0, "init", key[2].removeprefix("params.")))
    spans = rank_rows(got, key)
    if initial is None or spans is None or initial.shape != got.records[key].shape:
        return False
    loaded = got.records[key]
    return all(torch.equal(loaded[a:b], initial[a:b]) for r, a, b in spans if r in ranks)


def hint(
    first: Finding | None, ref: Trace, got: Trace, world_size: int, init: str = "eager", case: Case | None = None
) -> str:
    """`case`: where given, a gradient's factor is matched against the sizes of its mesh's groups
    (data-parallel, tp, pp, ep, the world); else against `world_size` (the step's item counts')."""
    if first is not None and first.phase == "precision" and first.kind == "contract":
        return precision_hint(first, got)
    if first is not None and first.phase == "build" and first.comparator == "ModelBuildCheck":
        return "build the model from the seed alone: every rank and the reference must construct the same model"
    if first is not None and first.phase == "resumed":
        return resume_hint(first, ref, got)
    if first is None or first.kind != "deviation" or first.key not in got.records:
        return ""  # a finding of no record (the compiled reference against eager: verify/checks/compiler.py)
    if first.phase == "loss":
        return loss_hint(first, got)
    a, b = ref.records[first.key], got.records[first.key]
    if first.phase == "init" and init == "meta":
        return (
            "initial parameters differ from an eager build: the meta-device build or its materialisation"
            " consumed or reordered random numbers (save and restore the RNG state; seed 004)"
        )
    if first.phase == "init":
        apart = _ranks_only(ref, got, first)
        if apart is not None:
            right, wrong = apart
            return (
                f"the initial shards of {first.name} differ on rank(s) {wrong} and agree on rank(s) {right}:"
                " those ranks initialised differently, or hold another slice"
            )
        return "initial parameters differ: ranks initialised differently, or a shard holds the wrong slice"
    if first.phase == "param_sums" and first.name == "__total__":
        total = a.double().sum().item()
        ratio = b.double().sum().item() / total if total != 0 else float("nan")
        return f"the parameter total is {ratio:.3g}x the reference's: a parameter may be held twice or missed"
    if first.phase == "grads":
        if case is not None:
            groups = evidence.step_groups(case, got, first.step)
        else:
            ranks = evidence.step_dp_size(got, first.step) or world_size
            groups = evidence.Groups(world=ranks, dp=ranks)
        said = _gradient_hint(first, ref, got, groups, _arithmetic_fit(case))
        if said:
            return said
    c = evidence.factor(a, b)
    if c is not None and not evidence.near(c, 1):
        return f"the sharded values are {c:.4g}x the reference's"
    apart = _ranks_only(ref, got, first) if first.phase in _RANK_ONLY else None
    if apart is not None:
        return _RANK_ONLY[first.phase].format(right=apart[0], wrong=apart[1], name=first.name)
    return ""


# Where only some ranks' rows of a record differ (and the others' are bit for bit the
# reference's), what that says, by phase. Records before it agreed: the difference arose on
# those ranks at this phase.
_RANK_ONLY = {
    "logits": (
        "only the samples of rank(s) {wrong} differ (those of rank(s) {right} agree bit for bit): the forward"
        " computes otherwise on those ranks"
    ),
    "grads": (
        "only rank(s) {wrong}'s shards of the reduced gradient {name} differ (rank(s) {right}'s agree bit for"
        " bit): changed on those ranks after the reduction (a change to a rank's gradient before the"
        " reduce-scatter reaches every rank's shard)"
    ),
    "params": (
        "only rank(s) {wrong}'s shards of {name} differ after the optimizer step (rank(s) {right}'s agree bit"
        " for bit, and the gradients agreed): the update on those ranks"
    ),
}


def _ranks_only(ref: Trace, got: Trace, first: Finding) -> tuple[list[int], list[int]] | None:
    """(ranks whose rows agree bit for bit, ranks whose rows are off by more than the
    tolerance) where both exist and no rank sits in between; else None."""
    apart = evidence.ranks_apart(ref, got, [first.key], first.tolerance)
    if apart is None or apart.unsure or not (apart.right and apart.wrong):
        return None
    return apart.right, apart.wrong


def _arithmetic_fit(case: Case | None) -> float:
    """How closely a gradient factor must fit, from the dtypes the case reduces and computes in."""
    if case is None:
        return evidence.FIT
    p = case.precision
    return evidence.fit_of(*(to_torch(d) for d in (p.reduce_dtype, p.param_dtype)))


def _gradient_hint(first: Finding, ref: Trace, got: Trace, groups: evidence.Groups, fit: float = evidence.FIT) -> str:
    """A gradient that is a multiple of the reference's: is it every gradient of the step (or,
    under ep, the experts' alone), and is the factor the size of a group of the ranks that ran
    the step? A group is named only where the factor is its size; where it is two groups' (1/2 at
    data-parallel 2 x tp 2), both are named."""
    a, b = ref.records[first.key], got.records[first.key]
    c = evidence.factor(a, b, max(fit, evidence.fit_of(a.dtype, b.dtype)))
    if c is None:
        return ""
    keys = [k for k in ref.records if k[0] == first.step and k[1] == "grads" and k in got.records]
    considered = [k for k in keys if ref.records[k].shape == got.records[k].shape and bool(ref.records[k].any())]
    alike = [k for k in considered if _has_factor(ref.records[k], got.records[k], c, fit)]
    every = len(alike) == len(considered)
    which = "every gradient of the step is" if every else f"the gradient {first.name} is"
    others = "" if every else f" ({len(alike)} of the step's {len(considered)} gradients are; the others are not)"
    if abs(c) < 1e-6:
        return f"{which} zero where the reference's is not{others}: no gradient reached the optimizer there"
    if groups.ep > 1 and not every:
        said = _experts_hint(c, considered, alike, ref, got, groups)
        if said:
            return said
    if groups.world != groups.dp:  # tp or pp: the world is not the data-parallel ranks
        causes = _divisions(c, groups) if every else []
        if not causes and not any(evidence.near(c, v) for v in _group_factors(groups)):
            return "" if evidence.near(c, 1) else f"{which} {c:.4g}x the reference's{others}"
        sizes = groups.text() + (f"; {others.strip()[1:-1]}" if others else "")
        return _said_with_causes(f"{which} {_fraction(c)} x the reference's ({sizes})", causes)
    world_size = groups.world
    for label, value in (("1/world_size", 1 / world_size), ("world_size", world_size)):
        if world_size < 2 or not evidence.near(c, value):
            continue
        if not every:
            return f"{which} {label} x the reference's (the world size: {world_size}){others}"
        if world_size == 2 and value == 2:
            return (
                f"{which} 2x the reference's: 2 is the world size, and twice. The records cannot tell a sum over"
                " the ranks never divided by the world size from a gradient added twice"
            )
        return (
            f"{which} {label} x the reference's (the world size: {world_size}): divided by the world size"
            f" {'once too often' if value < 1 else 'too rarely'}"
        )
    return "" if evidence.near(c, 1) else f"{which} {c:.4g}x the reference's{others}"


def _divisions(c: float, g: evidence.Groups) -> list[tuple[str, str]]:
    """What dividing every gradient by `c` can be, where the world is not the data-parallel ranks
    (tp, pp): (what was done, why it reads so) for each group size the factor is."""
    d, w = g.dp, g.world
    replicas = " and the ".join(n for n, k in (("tp ranks", g.tp), ("pp stages", g.pp)) if k > 1)
    out = []
    if evidence.near(c, d / w):
        out.append(
            (
                f"divided by the world size ({w}) where the data-parallel size ({d}) was meant",
                f"the {replicas} counted as replicas",
            )
        )
    if d > 1 and evidence.near(c, 1 / d):
        out.append(
            (f"divided by the data-parallel size ({d}) once too often", "a division on top of the reduction's average")
        )
    if d > 1 and evidence.near(c, 1 / w):  # at d == 1 this is the world taken for the data-parallel ranks, above
        out.append(
            (f"divided by the world size ({w}) once too often", "a `/ world_size` on top of the reduction's average")
        )
    for name, k in (("tp degree", g.tp), ("pp degree", g.pp)):
        if k > 1 and evidence.near(c, 1 / k) and not evidence.near(1 / k, d / w) and not (d > 1 and k == d):
            out.append((f"divided by the {name} ({k}) once too often", ""))
    if d > 1 and evidence.near(c, d):
        out.append((f"not divided by the data-parallel size ({d})", "summed over its ranks, not averaged"))
    m = g.microbatches
    if g.pp > 1 and m > 1 and evidence.near(c, m):
        why = (
            "each micro-batch's loss scaled for their mean, the sum kept"
            if g.scale_grads
            else "each micro-batch's loss scaled for a division by them the schedule does not make"
        )
        out.append((f"not divided by the micro-batches ({m})", why))
    if g.pp > 1 and m > 1 and evidence.near(c, 1 / m):
        why = (
            "the loss divided by them before the schedule's own division"
            if g.scale_grads
            else "the schedule's `scale_grads` on, where each micro-batch's loss is already its share of the step's"
        )
        out.append((f"divided by the micro-batches ({m}) once too often", why))
    if evidence.near(c, 2):
        out.append(("a gradient added twice", ""))
    return out


def _experts_hint(c, considered, alike, ref: Trace, got: Trace, g: evidence.Groups) -> str:
    """Under ep, the factor on the grouped experts' gradients alone (the dense ones agree): which
    of the experts' groups it is the size of."""
    experts = [k for k in considered if g.is_expert(k[2])]
    rest = [k for k in considered if k not in experts]
    if not experts or sorted(alike) != sorted(experts):
        return ""
    if not all(_has_factor(ref.records[k], got.records[k], 1.0) for k in rest):
        return ""
    e, d = g.ep, g.dp
    causes = []
    if evidence.near(c, 1 / e):
        causes.append(
            (f"divided by the ep degree ({e}) once too often", "averaged over the ep ranks, which hold other experts")
        )
    if d != e and evidence.near(c, 1 / d):
        causes.append((f"divided by the data-parallel size ({d}) once too often", ""))
    if d // e > 1 and evidence.near(c, e):
        causes.append(
            (
                f"divided by the {d // e} ranks the experts are sharded over where the data-parallel size ({d}) was"
                " meant",
                "the experts' units left at FSDP2's default divide factor",
            )
        )
    names = ", ".join(k[2] for k in experts)
    head = f"the experts' gradients ({names}) are {_fraction(c)} x the reference's and the others agree ({g.text()})"
    return _said_with_causes(head, causes) if causes else ""


def _group_factors(g: evidence.Groups) -> list[float]:
    sizes = {g.world, g.dp, g.tp, g.pp, g.world // g.dp, g.microbatches if g.pp > 1 else 1} - {1}
    return [f for n in sizes for f in (n, 1 / n)]


def _fraction(c: float) -> str:
    """1/4, 2, or the factor as a number where it is neither a whole number nor one's inverse."""
    if c > 0 and 1 / c >= 1.5 and evidence.near(1 / c, round(1 / c)):
        return f"1/{round(1 / c)}"
    if c >= 1.5 and evidence.near(c, round(c)):
        return str(round(c))
    return f"{c:.4g}"


def _said_with_causes(head: str, causes: list[tuple[str, str]]) -> str:
    """One cause: `head: cause: why`; several: each with its why in brackets, and that the
    records cannot tell them apart."""
    if not causes:
        return head
    if len(causes) == 1:
        what, why = causes[0]
        return f"{head}: {what}" + (f": {why}" if why else "")
    said = ", or ".join(f"{what} ({why})" if why else what for what, why in causes)
    return f"{head}: {said}; at these sizes the records cannot tell which"


def _has_factor(ref: torch.Tensor, got: torch.Tensor, c: float, fit: float = evidence.FIT) -> bool:
    """`got` is c x `ref` (to `fit`, or the records' own dtype's: two factors each that far
    from the true one are up to twice it apart)."""
    fit = max(fit, evidence.fit_of(ref.dtype, got.dtype))
    found = evidence.factor(ref, got, fit)
    return found is not None and (evidence.near(found, c, 2 * fit) if c != 0 else abs(found) < 1e-6)


def loss_hint(first: Finding, got: Trace) -> str:
    """The loss is the first record to part, so the logits it is computed from agreed: the loss
    itself is computed or normalised differently. With different numbers of real tokens per
    micro-batch or rank (padded batches), a per-micro-batch or per-rank mean is the usual cause."""
    counts = got.meta.get("items", {}).get(str(first.step))
    flat = [n for rank in counts or [] for n in rank]
    if len(set(flat)) > 1:
        return (
            "the loss differs although the logits agree: loss normalisation. Micro-batches and ranks hold"
            f" different numbers of real tokens ({counts}, per rank and micro-batch); scale each micro-batch's"
            " loss sum by dp_size / global_batch_tokens (seed 000), not by its own or its rank's token count"
        )
    return "the loss differs although the logits agree: the loss is computed or normalised differently"
