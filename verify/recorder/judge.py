"""Two recorded runs compared record by record: paired by step and stripped parameter name, each
deviation held to the rule rules.py derives for it, the data check first in every step."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from fsdp_verify.compare.finding import Finding
from fsdp_verify.recorder import datacheck, loadcheck, rules, sharding
from fsdp_verify.recorder.align import Rows, Step, deviation, steps
from fsdp_verify.recorder.store import Run, RunError

PHASES = ("init", "data", "modules", "logits", "loss", "grads", "params", "optim_state", "sharding")
COMPARATORS = {
    "init": "InitFingerprint",
    "modules": "ModuleFingerprint",
    "logits": "LogitsFingerprint",
    "loss": "LossRecord",
    "grads": "GradsFingerprint",
    "params": "ParamsFingerprint",
    "optim_state": "OptimStateFingerprint",
    "sharding": sharding.COMPARATOR,
}
DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _records(step: Step, order: list[int] | None) -> dict[tuple[str, str], object]:
    """(phase, name) -> value: a float (loss), Rows (fingerprints) or a tensor (recorded whole)."""
    out: dict[tuple[str, str], object] = {}
    if step.loss is not None:
        out[("loss", "loss")] = step.loss
    if step.logits is not None:
        lg = step.logits
        if order is not None:
            lg = Rows(lg.sum[order], lg.sq[order], lg.row_len)
        out[("logits", "logits")] = lg
    for name, rows in step.modules.items():  # samples along dim 0 when a call saw the whole batch
        if order is not None and rows.sum.numel() == len(order):
            rows = Rows(rows.sum[order], rows.sq[order], rows.row_len)
        out[("modules", name)] = rows
    for (k, kind), named in step.groups.items():
        phase = "init" if k == 0 else ("optim_state" if kind.startswith("optim.") else kind)
        suffix = f" [{kind.split('.', 1)[1]}]" if kind.startswith("optim.") else ""
        for name, rows in named.items():
            out[(phase, name + suffix)] = rows
            if rows.full is not None:
                out[(phase, name + suffix + " (whole)")] = rows.full
    return out


def _order(ref: Step, got: Step) -> list[int] | None:
    """The permutation that puts the sharded run's samples in the reference's order."""
    if ref.hashes is None or got.hashes is None:
        return None
    where: dict[int, list[int]] = {}
    for i, h in enumerate(torch.cat(got.hashes).tolist()):
        where.setdefault(h, []).append(i)
    order = []
    for h in torch.cat(ref.hashes).tolist():
        if not where.get(h):
            return None
        order.append(where[h].pop(0))
    return order


@dataclass
class Comparison:
    ref: Run
    got: Run
    calibration: Run | None
    findings: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    steps: int = 0  # steps both runs recorded, the ones compared (call 0, the initial state, is not a step)

    @property
    def judged(self) -> list[Finding]:
        return [f for f in self.findings if f.mode != "unjudged"]

    @property
    def ok(self) -> bool:
        return all(f.ok for f in self.findings)

    @property
    def not_sharded(self) -> list[Finding]:
        """Why the run recorded as sharded is not (sharding.py): its own verdict, before any record."""
        return [f for f in self.findings if f.phase == "sharding" and not f.ok]

    @property
    def first_divergence(self) -> Finding | None:
        """The first record of the two runs that parts (the sharding check aside)."""
        return next((f for f in self.findings if not f.ok and f.phase != "sharding"), None)

    def rules_used(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for f in self.findings:
            counts[f.mode or "check"] = counts.get(f.mode or "check", 0) + 1
        return counts


def record_dtype(run: Run, kind: str) -> torch.dtype:
    seen = [DTYPES.get(d, torch.float32) for m in run.meta for d in m.get("dtypes_seen", {}).get(kind, [])]
    return max(seen or [torch.float32], key=rules.unit_roundoff)


def precision(run: Run) -> dict:
    """What the Recorder saw of the run's rounding (recorder.precision_of); runs recorded before
    it was stored count as plain (no fully_shard policy known)."""
    return run.meta[0]["settings"].get("precision") or {"fully_shard": False, "policies": []}


def _coarse(prec: dict) -> bool:
    u32 = rules.unit_roundoff(torch.float32)
    return any(
        rules.unit_roundoff(DTYPES.get(p.get(k) or "float32", torch.float32)) > u32
        for p in prec["policies"]
        for k in ("param_dtype", "reduce_dtype")
    )


def _describe(prec: dict) -> str:
    if not prec["fully_shard"]:
        return "no fully_shard, no mixed precision policy (plain)"
    return "fully_shard with " + "; ".join(
        ", ".join(f"{k}={v}" for k, v in p.items() if k != "cast_forward_inputs") for p in prec["policies"]
    )


def mixed_pairing(ref: Run, got: Run) -> tuple[torch.dtype, torch.dtype] | str | None:
    """None: neither run has a coarse policy (the fp32 rules). (param_dtype, reduce_dtype): both ran
    fully_shard with the same policies, so they round at the same places (rules.bound). A string:
    why the pair cannot be judged (one side rounds where the other does not)."""
    rp, gp = precision(ref), precision(got)
    if not (_coarse(rp) or _coarse(gp)):
        return None
    if rp["fully_shard"] and gp["fully_shard"] and rp["policies"] == gp["policies"]:
        params = [DTYPES[p["param_dtype"]] for p in rp["policies"] if p["param_dtype"]] or [torch.float32]
        reduces = [DTYPES[p["reduce_dtype"] or p["param_dtype"] or "float32"] for p in rp["policies"]]
        return max(params, key=rules.unit_roundoff), max(reduces, key=rules.unit_roundoff)
    return (
        f"the runs round at different places, so only the initial parameters and the data were judged:"
        f" {got.path} ran {_describe(gp)}; {ref.path} ran {_describe(rp)}. A plain reference rounds"
        " differently from a mixed precision sharded run by far more than reordering. Record the reference"
        " under fully_shard on a one-rank mesh with the same MixedPrecisionPolicy (docs/recorder.md)"
    )


def _spread(ref: Rows, ref_step: Step, got_step: Step, name: str) -> float:
    """S of rules.bound_rounded: the largest row's magnitudes rounded by both runs, against the
    largest row norm of the reference's gradient (the normwise scale)."""
    scale = float(ref.norms.max()) if ref.norms.numel() else 0.0
    rounded = ref_step.rounding[name] + got_step.rounding[name]
    if scale == 0 or rounded.shape != ref.norms.shape:
        return 0.0  # nothing to scale by, or recorded for another shape: the plain bound
    return float(rounded.max()) / scale


def _check_pair(ref: Run, other: Run, what: str) -> None:
    a, b = {p[0]: p[1] for p in ref.meta[0]["params"]}, {p[0]: p[1] for p in other.meta[0]["params"]}
    if a.keys() != b.keys():
        only_a, only_b = sorted(a.keys() - b.keys()), sorted(b.keys() - a.keys())
        raise RunError(
            f"{what}: params: the runs record different parameters (names after stripping wrapper prefixes):"
            f" only in {ref.path}: {only_a[:5]}; only in {other.path}: {only_b[:5]}"
        )
    for name in a:
        if a[name] != b[name]:
            raise RunError(f"{what}: params: {name!r} has shape {b[name]} in {other.path}, {a[name]} in {ref.path}")


def compare_runs(ref_path, got_path, calibration_path=None, progress=None) -> Comparison:
    ref, got = Run(ref_path, "RUN_REF"), Run(got_path, "RUN_SHARDED")
    cal = Run(calibration_path, "--calibration") if calibration_path else None
    _check_pair(ref, got, "RUN_SHARDED")
    if cal is not None:
        _check_pair(ref, cal, "--calibration")
        if cal.meta[0]["settings"].get("perturb") is None:
            raise RunError(
                f"--calibration: {cal.path}: settings.perturb: not a perturbed run (set FSDP_VERIFY_PERTURB=1)"
            )
    pairing = mixed_pairing(ref, got)
    if cal is not None and precision(cal) != precision(ref):
        raise RunError(
            f"--calibration: {cal.path}: settings.precision: expected the reference's ({_describe(precision(ref))}),"
            f" got {_describe(precision(cal))}"
        )
    result = Comparison(ref, got, cal)
    if isinstance(pairing, str):
        result.notes.append(pairing)
    param_dtype, reduce_dtype = pairing if isinstance(pairing, tuple) else (torch.float32, torch.float32)
    common = sorted(set(ref.calls[0]) & set(got.calls[0]))
    result.steps = len([c for c in common if c > 0])
    if set(ref.calls[0]) != set(got.calls[0]):
        result.notes.append(
            # call 0 is the state before the first step (verify/recorder/store.py), not a step
            f"the runs recorded {len(ref.calls[0]) - 1} and {len(got.calls[0]) - 1} steps;"
            f" compared the {result.steps} both have"
        )
    cal_steps = {s.call: s for s in steps(cal)} if cal is not None else {}
    if got.before is not None:
        k = got.resumed_after
        result.notes.append(
            f"RUN_SHARDED resumed after step {k}: steps 1-{k} from {got.before.path} (world size"
            f" {got.before.world_size}), steps {k + 1}-{got.calls[0][-1]} from {got.path} (world size"
            f" {got.world_size}); the state right after the load is held exactly to the one it saved, at step {k}"
        )
    # The loads of a resumed run (either side): compared once their step's records are in.
    loads: dict[int, list[Finding]] = {}
    for label, run in (("RUN_REF", ref), ("", got)):
        found, note = loadcheck.check(run, label)
        if note:
            result.notes.append(note)
        if run.before is not None:
            loads.setdefault(run.resumed_after, []).extend(found)
    unsharded = sharding.unsharded(got)
    if unsharded is not None:
        result.findings.append(unsharded)
    elif (partly := sharding.partly_plain(got)) is not None:
        result.notes.append(partly)
    unjudged = one_sided = mismatched = 0
    for r_step, g_step in zip(steps(ref), steps(got)):
        if r_step.call not in common:
            continue
        world = got.world_at(r_step.call)
        if progress:
            progress(r_step.call)
        result.findings.extend(sharding.drift(g_step, got, record_dtype(got, "params")))
        if r_step.hashes is not None and g_step.hashes is not None:
            result.findings.append(datacheck.check(r_step.call, r_step.hashes, g_step.hashes))
        ref_rec, got_rec = _records(r_step, None), _records(g_step, _order(r_step, g_step))
        c_step = cal_steps.get(r_step.call)
        cal_rec = _records(c_step, None) if c_step is not None else {}
        ran = {name: i for i, name in enumerate(r_step.modules)}  # modules: the order they ran, not by name
        for key in sorted(
            ref_rec.keys() | got_rec.keys(), key=lambda k: (PHASES.index(k[0]), ran.get(k[1], len(ran)), k[1])
        ):
            phase, name = key
            base = dict(step=r_step.call, phase=phase, name=name, comparator=COMPARATORS[phase])
            if (key not in got_rec or key not in ref_rec) and name.endswith(" (whole)"):
                # Stored whole by one run only (other full_steps/full_params): the fingerprints still compare.
                one_sided += 1
                continue
            if key not in got_rec or key not in ref_rec:
                side = "the sharded run" if key not in got_rec else "the reference"
                result.findings.append(Finding(ok=False, kind="missing", message=f"not recorded by {side}", **base))
                continue
            a, b = ref_rec[key], got_rec[key]
            shapes = [tuple(x.sum.shape) if isinstance(x, Rows) else tuple(getattr(x, "shape", ())) for x in (a, b)]
            if shapes[0] != shapes[1]:
                what = "samples" if phase in ("logits", "modules") else "shape"
                msg = f"{what} {shapes[1]} on the sharded run's ranks together, {shapes[0]} in the reference"
                result.findings.append(Finding(ok=False, kind="shape", message=msg, **base))
                continue
            dtype = record_dtype(got, phase if phase in ("logits", "loss", "modules") else "params")
            dtype = max(dtype, param_dtype, key=rules.unit_roundoff)  # under a policy: rounded in param_dtype
            before_update = phase == "init" or (phase in ("modules", "logits", "loss") and r_step.opt_before == 0)
            before_update |= phase == "grads" and r_step.opt_before == 0 and 1 in r_step.opt_steps
            if phase == "init":
                tol = rules.exact_fp64(a.row_len if isinstance(a, Rows) else 1)
                if not isinstance(a, Rows):
                    tol = rules.Tolerance("exact", 0.0, "the same values: sharding moves bits, nothing rounds")
            elif isinstance(pairing, str):
                tol = rules.unjudged(dtype, world, why="the runs ran different precision policies (see the note)")
                mismatched += 1
            elif before_update and phase == "grads" and name in r_step.rounding and name in g_step.rounding:
                tol = rules.bound_rounded(dtype, world, reduce_dtype, _spread(a, r_step, g_step, name), param_dtype)
            elif before_update:
                tol = rules.bound(dtype, world, reduce_dtype)
            elif key in cal_rec:
                tol = rules.calibrated(dtype, world, deviation(a, cal_rec[key]), reduce_dtype)
            else:
                tol = rules.unjudged(dtype, world, reduce_dtype)
                unjudged += 1
            dev = deviation(a, b)
            ok = dev <= tol.limit or tol.mode == "unjudged"
            if isinstance(a, Rows):
                msg = f"sum {a.total:.10g} vs {b.total:.10g}, norm {math.sqrt(float(a.sq.sum())):.10g} vs {math.sqrt(float(b.sq.sum())):.10g}"
            elif isinstance(a, float):
                msg = f"{a:.10g} vs {b:.10g}"
            else:
                msg = "recorded whole"
            result.findings.append(
                Finding(
                    ok=ok,
                    kind="deviation",
                    normwise=dev,
                    tolerance=tol.limit,
                    mode=tol.mode,
                    why=tol.why,
                    message=msg,
                    **base,
                )
            )
        result.findings.extend(loads.pop(r_step.call, []))  # the state loaded after this step
    for found in loads.values():  # a load at a step neither run compared: after the rest
        result.findings.extend(found)
    if mismatched:
        result.notes.append(f"{mismatched} records were not judged: the runs ran different precision policies")
    if one_sided:
        result.notes.append(
            f"{one_sided} tensors were stored whole by one run only (full_steps/full_params differ): compared by fingerprint"
        )
    if unjudged and cal is None:
        result.notes.append(
            f"{unjudged} records after the first optimizer step were not judged (shown against the step-1 bound for"
            " information): without a calibration run there is no derived limit for rounding compounded through the"
            " optimizer. Record the reference script again with FSDP_VERIFY_PERTURB=1 and pass it as --calibration."
        )
    elif unjudged:
        result.notes.append(
            f"{unjudged} records after the first optimizer step have no twin in the calibration run and were not judged:"
            " record it with the same full_steps and full_params as the reference."
        )
    return result
