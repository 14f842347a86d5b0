"""Verdict: pass or fail, every finding, and where the two runs first part."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fsdp_verify.case import Case
from fsdp_verify.compare.finding import Finding
from fsdp_verify.trace import PHASES, sort_key

PHASE_TITLES = {
    "build": "model build",
    "ownership": "parameter ownership",
    "init": "initial parameters",
    "buffers": "buffers",
    "precision": "precision contract",
    "rng": "random state",
    "modules": "module outputs",
    "logits": "logits",
    "loss": "loss",
    "module_grads": "module gradients",
    "ops": "operations",
    "op_inputs": "operation inputs",
    "grads": "gradients",
    "loss_scale": "loss scale and skip decision",
    "grad_norm": "clip total norm",
    "params": "parameters after the step",
    "param_sums": "parameter sums",
    "optim_state": "optimizer state",
    "resumed": "state right after the resume's load",
    "comm": "communication contract",
    "memory": "memory contract",
    "compile": "compilation (graphs, breaks, recompilations)",
    "compiler": "compiled against eager (the compiler's, not the sharding's)",
    "dims": "a dimension's own arithmetic against its derived bound (not the sharding's)",
}


@dataclass
class Verdict:
    case: Case
    findings: list[Finding]
    hint: str = ""
    seconds: dict[str, float] = field(default_factory=dict)
    calibrated: bool = False
    # fp16 loss scaling: per step, the reference's scale and skip decision and the ranks' (from
    # the "loss_scale" records), for the line `check` prints; empty in unscaled cases.
    loss_scales: list[dict[str, Any]] = field(default_factory=list)
    # In place under torchrun: the global ranks whose processes ran the reference's passes (those
    # on rank 0's host, verify/sharded/torchrun.py); None for a pool's run.
    reference_ranks: list[int] | None = None
    # A zoom into the first diverging step (verify/zoom/locate.py), when one ran.
    zoom: Any = None

    @property
    def ok(self) -> bool:
        return all(f.ok for f in self.findings)

    @property
    def failures(self) -> list[Finding]:
        return sorted((f for f in self.findings if not f.ok), key=lambda f: sort_key(f.key))

    @property
    def first_divergence(self) -> Finding | None:
        fails = self.failures
        return fails[0] if fails else None

    def worst(self) -> Finding | None:
        numeric = [f for f in self.findings if f.kind == "deviation"]
        return max(numeric, key=lambda f: f.ratio, default=None)

    def summary(self) -> str:
        c = self.case
        what = (
            f"{c.engine} vs the reference ({c.model.factory or c.model.kind}, world size {c.world_size}, {c.precision.describe()},"
            f"{' ' + c.loss_scaling.describe() + ',' if c.loss_scaling is not None else ''} {c.steps} steps,"
            f"{_resume_text(c)} case {c.hash})"
        )
        first = self.first_divergence
        if first is None:
            worst = self.worst()
            tail = f" Worst deviation: {worst.ratio:.3g}x its tolerance ({_where(worst)})." if worst else ""
            return f"EQUIVALENT: {what}: all {len(self.findings)} records agree.{tail}{self._notes()}"
        agreed = sum(1 for f in self.findings if sort_key(f.key) < sort_key(first.key))
        text = f"DIVERGED: {what}. First divergence at {_where(first)}: "
        if first.kind == "deviation":
            text += (
                f"off by {first.normwise:.3g} of its largest element (max abs {first.max_abs:.3g}, "
                f"{first.max_ulp} ulp), {first.ratio:.3g}x the {first.mode} tolerance {first.tolerance:.3g} "
                f"({first.why})."
            )
        else:
            text += f"{first.message}."
        later = len(self.failures) - 1
        if agreed or later:  # a run stopped before its first step has neither
            text += f" {agreed} earlier records agreed; {later} later records also diverge."
        if self.hint:
            text += f" Hint: {self.hint}"
        return text + self._notes()

    def _notes(self) -> str:
        """What the toolkit changed in the run that the user should know of (kind "note")."""
        return "".join(f" Note: {f.message}." for f in self.findings if f.kind == "note")

    def table(self) -> str:
        """Steps x phases: the worst ratio of deviation to tolerance in each cell, FAIL marked."""
        cells: dict[tuple[int, str], list[Finding]] = {}
        for f in self.findings:
            cells.setdefault((f.step, f.phase), []).append(f)
        # "build" is shown only when it has something to say (a user's model, or a failure),
        # "loss_scale" only in loss-scaled cases, "resumed" only in resumed ones.
        optional = (
            "build",
            "loss_scale",
            "resumed",
            "modules",
            "module_grads",
            "ops",
            "op_inputs",
            "compile",
            "compiler",
            "dims",
        )
        phases = [p for p in PHASES if p not in optional or any(ph == p for _, ph in cells)]
        rows = [["step"] + phases]
        for step in sorted({s for s, _ in cells}):
            row = [str(step)]
            for phase in phases:
                fs = cells.get((step, phase))
                if not fs:
                    row.append("-")
                    continue
                row.append(cell_text(fs))
            rows.append(row)
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
        legend = (
            "cells: worst deviation/tolerance ratio of the records in that step and phase (<1 passes);"
            " ok: a check (ownership, precision contract, RNG) ran and passed; n/a: nothing for it to read"
        )
        return "\n".join(lines + [legend])

    def loss_scale_line(self) -> str:
        """One line per loss-scaled case: each step's scale and whether it was skipped, the
        reference's and, where they differ, the ranks'."""
        if not self.loss_scales:
            return ""
        parts = []
        for row in self.loss_scales:
            text = f"{row['step']}: {row['scale']:.10g} {'skipped' if row['skipped'] else 'stepped'}"
            ranks = row.get("ranks")
            if ranks is not None and any(r != [row["scale"], row["skipped"]] for r in ranks):
                text += " (ranks: " + ", ".join(f"{s:.10g} {'skipped' if k else 'stepped'}" for s, k in ranks) + ")"
            parts.append(text)
        return "loss scale per step (the reference; every rank agrees unless listed): " + "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        first = self.first_divergence
        return {
            "ok": self.ok,
            "case_hash": self.case.hash,
            "case": self.case.to_dict(),
            "summary": self.summary(),
            "first_divergence": first.to_dict() if first else None,
            "hint": self.hint,
            "calibrated": self.calibrated,
            "seconds": self.seconds,
            "findings": [f.to_dict() for f in sorted(self.findings, key=lambda f: sort_key(f.key))],
            **({"loss_scales": self.loss_scales} if self.loss_scales else {}),
            **({"reference_ranks": self.reference_ranks} if self.reference_ranks is not None else {}),
            **({"zoom": self.zoom.to_dict()} if self.zoom is not None else {}),
        }

    def save_json(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2, default=json_default) + "\n")
        return path


def cell_text(findings: list[Finding]) -> str:
    """One table cell: FAIL xN, the worst ratio of its numeric records ("exact" at 0), or "ok" /
    "n/a" for a cell holding only a check's verdict."""
    bad = sum(1 for f in findings if not f.ok)
    if bad:
        return f"FAIL x{bad}"
    numeric = [f.ratio for f in findings if f.kind == "deviation"]
    if numeric:
        worst = max(numeric)
        return "exact" if worst == 0 else f"{worst:.2g}"
    if any(f.kind == "check" for f in findings):
        return "ok"
    return "n/a" if any(f.kind == "skipped" for f in findings) else "-"


def _where(f: Finding) -> str:
    return f"step {f.step}, {PHASE_TITLES[f.phase]}, {f.name!r}"


def json_default(o: Any) -> Any:
    if isinstance(o, float):
        return str(o)
    return repr(o)


def _resume_text(case: Case) -> str:
    """` resumed after step K on N ranks (mesh, engine),` for a case with a resume (docs/resume.md)."""
    if case.resume_after is None:
        return ""
    after = case.after_resume()
    mesh = f" mesh {after.mesh_shape}" if after.mesh_shape is not None else ""
    engine = f" with {after.engine}" if after.engine != case.engine else ""
    tp = f" tp {after.tp}" if after.tp != case.tp else ""
    degrees = "".join(
        f" {name} {getattr(after, name)}" for name in ("ep", "pp") if getattr(after, name) != getattr(case, name)
    )
    return f" resumed after step {case.resume_after} on {after.world_size} ranks{mesh}{tp}{engine}{degrees},"
