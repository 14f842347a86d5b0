"""Shrink a failing Case to a minimal one that still fails the same way (delta debugging).

A failure found by a nightly run or in a user's config is usually big: four ranks, many layers,
clipping, bf16. The shrinker tries smaller variants of the case (fewer steps, ranks, layers,
micro-batches; narrower widths; features off; smaller batch) one at a time and keeps a variant only
if it fails THE SAME WAY: the same comparator at the same phase for the first divergence, or the
same kind of rank failure (crash, error, hang). Keeping only same-way failures stops the search
from wandering off to a different bug that a smaller case happens to trigger (or to a case that
breaks the toolkit instead of the engine). It is greedy: per group of reductions the most
aggressive variant that still fails is kept, and passes repeat until none changes the case (a
fixed point) or the run budget is spent. Runs go through the warm rank pools
(`fsdp_verify.sharded.pool.get_pool`) and `fsdp_verify.runner.check_case`, so a candidate costs a fraction of a
second instead of a process start.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from fsdp_verify.case import Case, CaseError, ModelSpec
from fsdp_verify.case_specs import OptimSpec, PrecisionSpec
from fsdp_verify.runner import check_case
from fsdp_verify.sharded.pool import RankFailure, get_pool
from fsdp_verify.verdict import Verdict

DEFAULT_MAX_RUNS = 200


@dataclass(frozen=True)
class Signature:
    """How a case fails. `kind` is "diverged" (what = the first divergence's comparator, phase its
    phase) or "rank failure" (what = the RankFailure kind; phase unused, as it names a step)."""

    kind: str
    what: str
    phase: str = ""

    def __str__(self) -> str:
        if self.kind == "diverged":
            return f"first divergence in {self.phase} ({self.what})"
        return f"rank {self.what}"


@dataclass
class Outcome:
    """One run of a case: its failure signature (None = it passed) and what it produced."""

    signature: Signature | None
    verdict: Verdict | None = None
    failure: RankFailure | None = None


@dataclass
class ShrinkResult:
    original: Case
    case: Case  # the smallest case found that fails like the original (the original if none)
    outcome: Outcome  # the run of `case`
    runs: int = 0  # candidate runs spent (the first run of the original not counted)
    kept: list[str] = field(default_factory=list)  # the reductions kept, in order
    budget_exhausted: bool = False

    @property
    def fails(self) -> bool:
        return self.outcome.signature is not None


def run_once(case: Case, timeout_s: float | None = None, calibrate: bool = True) -> Outcome:
    """Run `case` on both sides. A RankFailure of kind "start" (the pool could not even start) is
    raised: it says nothing about the case."""
    try:
        verdict = check_case(case, get_pool(case.world_size), timeout_s=timeout_s, calibrate=calibrate)
    except RankFailure as e:
        if e.kind == "start":
            raise
        return Outcome(Signature("rank failure", e.kind), failure=e)
    first = verdict.first_divergence
    if first is None:
        return Outcome(None, verdict=verdict)
    return Outcome(Signature("diverged", first.comparator, first.phase), verdict=verdict)


def shrink(
    case: Case,
    max_runs: int = DEFAULT_MAX_RUNS,
    timeout_s: float | None = None,
    calibrate: bool = True,
    progress: Callable[[str], None] | None = None,
) -> ShrinkResult:
    """Greedy delta debugging over `case`. Returns the original unchanged when it does not fail."""
    say = progress or (lambda _msg: None)
    outcome = run_once(case, timeout_s, calibrate)
    result = ShrinkResult(case, case, outcome)
    if outcome.signature is None:
        say("the case does not fail: nothing to shrink")
        return result
    target = outcome.signature
    say(f"the case fails: {target}; shrinking (at most {max_runs} runs)")
    seen = {case.hash}  # hashes of cases already run
    changed = True
    while changed and not result.budget_exhausted:
        changed = False
        for group in REDUCTIONS:
            for label, candidate in _valid(result.case, group(result.case)):
                if candidate.hash in seen:  # the same case reached another way: already judged
                    continue
                if result.runs >= max_runs:
                    result.budget_exhausted = True
                    say(f"budget of {max_runs} runs spent; stopping")
                    break
                result.runs += 1
                try:
                    tried = run_once(candidate, timeout_s, calibrate)
                except RankFailure as e:  # the pool for this world size cannot start: skip it
                    say(f"[{result.runs}/{max_runs}] {label}: could not run ({e}); skipped")
                    seen.add(candidate.hash)
                    continue
                seen.add(candidate.hash)
                if tried.signature != target:
                    how = "passes" if tried.signature is None else f"fails differently ({tried.signature})"
                    say(f"[{result.runs}/{max_runs}] {label}: {how}; rejected")
                    continue
                say(f"[{result.runs}/{max_runs}] {label}: still fails the same way; kept")
                _release_pool(result.case, candidate)
                result.case, result.outcome = candidate, tried
                result.kept.append(label)
                changed = True
                break  # next group, starting from the smaller case
            if result.budget_exhausted:
                break
    return result


def _release_pool(old: Case, new: Case) -> None:
    """The shrinker never grows the world size again: stop the bigger pool's ranks to free the
    machine (`get_pool` restarts it if anyone asks again)."""
    if new.world_size < old.world_size:
        get_pool(old.world_size).close()


def _valid(case: Case, candidates: Candidates) -> Iterator[tuple[str, Case]]:
    """`case` with each candidate's changes; a change the Case or its engine rejects (e.g. a world
    size an int reshard_after_forward does not divide: verify/engines/capabilities.py) is not a
    candidate."""
    from fsdp_verify.engines import refuse_untakeable

    for label, changes in candidates:
        try:
            candidate = case.with_(**changes)
            refuse_untakeable(candidate)
        except CaseError:
            continue
        yield label, candidate


# ---- reductions: each maps the current case to candidates, most aggressive first ---------------------
Candidates = list[tuple[str, dict[str, Any]]]  # (label, changes for Case.with_)


def _smaller_ints(value: int, floor: int = 1) -> list[int]:
    """floor, value // 2, value - 1: the first is the bravest, the last the gentlest."""
    out: list[int] = []
    for v in (floor, value // 2, value - 1):
        if floor <= v < value and v not in out:
            out.append(v)
    return out


def _fit_batch(batch: int, per: int) -> int:
    """The batch rounded up to a multiple of world_size * microbatches."""
    return -(-batch // per) * per


def _steps(c: Case) -> Candidates:
    return [(f"steps {c.steps} -> {n}", {"steps": n}) for n in _smaller_ints(c.steps)]


def _world_size(c: Case) -> Candidates:
    out: Candidates = []
    if c.mesh_shape is not None and len(c.mesh) == 2:
        out.append((f"mesh {c.mesh} -> ({c.world_size},)", {"mesh_shape": None}))
    for ws in sorted({1, 2, c.world_size // 2, c.world_size - 1}):
        if 1 <= ws < c.world_size:
            batch = _fit_batch(c.data.batch_size, ws * c.microbatches)
            changes = {"world_size": ws, "mesh_shape": None, "data.batch_size": batch}
            out.append((f"world size {c.world_size} -> {ws}", changes))
    return out


def _microbatches(c: Case) -> Candidates:
    return [
        (f"microbatches {c.microbatches} -> {n}", {"microbatches": n, "sync_every_microbatch": True})
        for n in _smaller_ints(c.microbatches)
    ]


def _fit_wrap(c: Case, model: ModelSpec) -> tuple[str, ...] | None:
    """A custom wrap plan without the modules the smaller model no longer has (None = default)."""
    if c.wrap is None:
        return None
    from fsdp_verify.models import module_classes, module_names

    names = module_names(model) | set(module_classes(model).values())  # FQNs and class names
    kept = tuple(fqn for fqn in c.wrap if fqn in names)
    return kept if kept and kept[-1] == "" else None


def _with_model(c: Case, label: str, **model_changes: Any) -> tuple[str, dict[str, Any]]:
    model = replace(c.model, **model_changes)
    return label, {"model": model, "wrap": _fit_wrap(c, model)}


def _kwargs(c: Case, label: str, **kwargs: Any) -> tuple[str, dict[str, Any]]:
    return _with_model(c, label, kwargs={**c.model.kwargs, **kwargs})


def _custom_sizes(c: Case) -> Candidates:
    """A user's model: each kwarg it marks shrinkable (layers, widths) lowered, and shorter
    sequences. A combination the factory rejects (heads that no longer divide the width) is
    no candidate: it fails validation, naming model.factory."""
    m = c.model
    out = []
    for name in m.shrinkable:
        value = m.kwargs[name]
        out += [_kwargs(c, f"{name} {value} -> {n}", **{name: n}) for n in _smaller_ints(value)]
    out += [_with_model(c, f"seq_len {m.seq_len} -> {n}", seq_len=n) for n in _smaller_ints(m.seq_len)]
    return out


def _layers(c: Case) -> Candidates:
    m = c.model
    if m.is_custom:
        return _custom_sizes(c)
    if m.kind == "mlp":
        w = m.widths
        out = [_with_model(c, f"layers {len(w) - 1} -> 1", widths=(w[0], w[-1]))] if len(w) > 2 else []
        for i in range(1, len(w) - 1):  # drop one hidden width = one layer fewer
            out.append(
                _with_model(c, f"layers {len(w) - 1} -> {len(w) - 2} (drop width {w[i]})", widths=w[:i] + w[i + 1 :])
            )
        return out
    return [_with_model(c, f"n_layers {m.n_layers} -> {n}", n_layers=n) for n in _smaller_ints(m.n_layers)]


def _widths(c: Case) -> Candidates:
    m = c.model
    if m.is_custom:
        return []  # the shrinkable kwargs, in _layers
    if m.kind == "mlp":
        halved = tuple(max(1, v // 2) for v in m.widths)
        out = [_with_model(c, f"widths {m.widths} -> {halved}", widths=halved)] if halved != m.widths else []
        for i, v in enumerate(m.widths):
            if v > 1:
                w = m.widths[:i] + (max(1, v // 2),) + m.widths[i + 1 :]
                out.append(_with_model(c, f"widths {m.widths} -> {w}", widths=w))
        return out
    out = []
    for name in ("dim", "ffn_hidden", "vocab_size", "seq_len", "n_heads"):
        value = getattr(m, name)
        if value > 1:
            out.append(_with_model(c, f"{name} {value} -> {max(1, value // 2)}", **{name: max(1, value // 2)}))
    return out


def _feature(label: str, get: Callable[[Case], Any], off: Any, key: str) -> Callable[[Case], Candidates]:
    def candidates(c: Case) -> Candidates:
        value = get(c)
        if value == off and type(value) is type(off):  # reshard_after_forward 1 is not True
            return []
        return [(f"{label} {value!r} -> {off!r}", {key: off})]

    return candidates


def _tie_off(c: Case) -> Candidates:
    return [_with_model(c, "tie_embeddings True -> False", tie_embeddings=False)] if c.model.tie_embeddings else []


def _precision(c: Case) -> Candidates:
    """All fp32 first; else one field at a time. A change that leaves no fp16 drops the loss
    scaling with it (a Case refuses loss scaling without fp16)."""
    p = c.precision
    if p.is_full_precision:
        return []
    options = [(f"precision ({p.describe()}) -> fp32", PrecisionSpec())]
    for name in ("output_dtype", "reduce_dtype", "param_dtype"):
        if getattr(p, name) not in (None, "fp32"):
            options.append((f"precision.{name} {getattr(p, name)} -> None", replace(p, **{name: None})))
    out: Candidates = []
    for label, after in options:
        changes: dict[str, Any] = {"precision": after}
        if c.loss_scaling is not None and not after.uses_fp16:
            changes["loss_scaling"] = None
        out.append((label, changes))
    return out


def _optimizer(c: Case) -> Candidates:
    plain = OptimSpec(name="sgd", lr=c.optim.lr, momentum=0.0, weight_decay=0.0)
    if c.optim == plain:
        return []
    return [(f"optimizer {c.optim.name} -> plain sgd", {"optim": plain})]


def _wrap(c: Case) -> Candidates:
    return [] if c.wrap is None else [("wrap plan -> the default", {"wrap": None})]


def _batch(c: Case) -> Candidates:
    per = c.world_size * c.microbatches
    sizes = sorted({per, _fit_batch(c.data.batch_size // 2, per)})
    return [(f"batch {c.data.batch_size} -> {b}", {"data.batch_size": b}) for b in sizes if b < c.data.batch_size]


# Order matters for speed: what makes every later run cheaper (steps, ranks) goes first.
REDUCTIONS: list[Callable[[Case], Candidates]] = [
    _steps,
    _world_size,
    _microbatches,
    _layers,
    _feature("clip_norm", lambda c: c.clip_norm, None, "clip_norm"),
    _feature("dropout", lambda c: c.model.dropout, 0.0, "model.dropout"),
    _tie_off,
    _feature("frozen", lambda c: c.model.frozen, (), "model.frozen"),
    _feature("data.kind", lambda c: c.data.kind, "normal", "data.kind"),
    _feature("data.scale", lambda c: c.data.scale, 1.0, "data.scale"),
    _feature("data.padded", lambda c: c.data.padded, False, "data.padded"),
    _feature("init", lambda c: c.init, "eager", "init"),
    _feature("sync_every_microbatch", lambda c: c.sync_every_microbatch, True, "sync_every_microbatch"),
    _feature("reshard_after_forward", lambda c: c.reshard_after_forward, True, "reshard_after_forward"),
    _feature("cast_forward_inputs", lambda c: c.precision.cast_forward_inputs, True, "precision.cast_forward_inputs"),
    _precision,
    _optimizer,
    _wrap,
    _widths,
    _batch,
]


def describe(case: Case) -> str:
    """One line: the case's size and every feature that is on."""
    m = case.model
    if m.is_custom:
        model = f"{m.factory} {m.kwargs}, seq {m.seq_len}"
    elif m.kind == "mlp":
        model = f"mlp widths {list(m.widths)}"
    else:
        model = f"transformer {m.n_layers} layers, dim {m.dim}, {m.n_heads} heads, ffn {m.ffn_hidden}"
        model += f", vocab {m.vocab_size}, seq {m.seq_len}"
    mesh = f" mesh {list(case.mesh)}" if len(case.mesh) == 2 else ""
    parts = [
        model,
        f"world size {case.world_size}{mesh}",
        f"{case.steps} step{'s' * (case.steps != 1)}",
        f"batch {case.data.batch_size}",
        f"{case.microbatches} micro-batch{'es' * (case.microbatches != 1)}",
        case.precision.describe(),
        case.optim.name,
    ]
    on = [
        (case.clip_norm is not None, lambda: f"clip {case.clip_norm}"),
        (m.dropout > 0, lambda: f"dropout {m.dropout}"),
        (m.tie_embeddings, lambda: "tied embeddings"),
        (bool(m.frozen), lambda: f"frozen {list(m.frozen)}"),
        (case.data.kind != "normal", lambda: f"data {case.data.kind}"),
        (case.data.padded, lambda: "padded sequences"),
        (case.init != "eager", lambda: "meta init"),
        (not case.sync_every_microbatch, lambda: "grads accumulated unsharded"),
        (case.reshard_after_forward is not True, lambda: f"reshard_after_forward {case.reshard_after_forward}"),
        (case.wrap is not None, lambda: f"wrap {list(case.wrap or ())}"),
    ]
    parts += [text() for is_on, text in on if is_on]
    return ", ".join(parts) + f"; engine {case.engine}"
