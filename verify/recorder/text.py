"""What `fsdp-verify compare` prints: the steps x phases table, the rules used, and the summary
naming the first divergence (step, what, name, deviation, tolerance, the rule and why)."""

from __future__ import annotations

from fsdp_verify.recorder.judge import PHASES, Comparison

TITLES = {
    "init": "initial parameters",
    "data": "data",
    "modules": "module outputs",
    "logits": "logits",
    "loss": "loss",
    "grads": "gradients",
    "params": "parameters after the optimizer step",
    "optim_state": "optimizer state",
    "sharding": "sharding",
}
RULES = {
    "exact": "the same values (step 0): float64 fingerprints may differ only by summation order",
    "bound": "before any optimizer update: a few units of roundoff of the magnitude (reassociated sums, the DP average)",
    "calibrated": "after an update: 10x the reference's deviation from its perturbed rerun, never below the bound",
    "unjudged": "after an update, without a calibration run: shown against the bound, cannot fail",
    "check": "the data check: every sample of the reference's batch on exactly one rank; the sharding check",
    "replica": "a tensor more than one rank holds: the same values on every rank (the bound, no reduction)",
}


def _cell(findings) -> str:
    bad = sum(1 for f in findings if not f.ok)
    if bad:
        return f"FAIL x{bad}"
    if all(f.kind == "check" for f in findings):
        return "ok"
    judged = [f.ratio for f in findings if f.kind == "deviation" and f.mode != "unjudged"]
    if judged:
        return "exact" if max(judged) == 0 else f"{max(judged):.2g}"
    shown = max(f.normwise / f.tolerance for f in findings if f.tolerance)
    return f"({shown:.2g})"


def table(c: Comparison) -> str:
    cells: dict[tuple[int, str], list] = {}
    for f in c.findings:
        cells.setdefault((f.step, f.phase), []).append(f)
    phases = [p for p in PHASES if any(ph == p for _, ph in cells)]
    rows = [["step"] + phases]
    for step in sorted({s for s, _ in cells}):
        rows.append([str(step)] + [_cell(cells[(step, p)]) if (step, p) in cells else "-" for p in phases])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines.append("cells: worst deviation/tolerance of the step's records (<1 passes); (x): unjudged, for information")
    return "\n".join(lines)


def rules(c: Comparison) -> str:
    used = c.rules_used()
    return "\n".join(f"  {mode:10s} {n:5d} records: {RULES.get(mode, mode)}" for mode, n in sorted(used.items()))


def where(f) -> str:
    return f"step {f.step}, {TITLES[f.phase]}, {f.name!r}"


def summary(c: Comparison) -> str:
    what = (
        f"{c.got.path} (world size {c.got.world_size}) vs {c.ref.path} (world size {c.ref.world_size}),"
        f" {c.steps} steps compared{', calibrated by ' + str(c.calibration.path) if c.calibration else ''}"
    )
    first = c.first_divergence
    if c.not_sharded:
        plain = [f for f in c.not_sharded if f.kind == "sharding"]
        parted = [f for f in c.not_sharded if f.kind == "deviation"]
        reasons = [plain[0].message] if plain else []
        if parted:
            f = parted[0]
            reasons.append(
                f"at step {f.step}, {f.message} (off by {f.normwise:.3g} normwise, {f.ratio:.3g}x the {f.mode} tolerance)"
            )
        records = [f for f in c.judged if f.phase != "sharding"]
        numbers = (
            f"the first of its records to part from the reference: {where(first)}"
            + (f" ({first.message})" if first.kind != "deviation" else "")
            if first
            else f"all {len(records)} judged records agree with the reference, as a run that is not sharded can"
        )
        return f"NOT SHARDED: {what}: {'; and '.join(reasons)}. Not compared as a sharded run; {numbers}."
    if first is None:
        judged = [f for f in c.judged if f.kind == "deviation"]
        worst = max(judged, key=lambda f: f.ratio, default=None)
        tail = f" Worst: {worst.ratio:.3g}x its {worst.mode} tolerance ({where(worst)})." if worst else ""
        return f"EQUIVALENT: {what}: all {len(c.judged)} judged records agree.{tail}"
    text = f"DIVERGED: {what}. First divergence at {where(first)}: "
    if first.kind == "deviation":
        text += (
            f"off by {first.normwise:.3g} (normwise; {first.message}), {first.ratio:.3g}x the {first.mode}"
            f" tolerance {first.tolerance:.3g} ({first.why})."
        )
    else:
        text += f"{first.message}."
    return text
