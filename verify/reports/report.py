"""Building the one report (see report.schema.json) from what a command ran: a row per case with
its worst ratio per comparator and step, the per-comparator summary diff and trend compare, and
the failures first. Every command's report.json goes through `finish`, so all four agree."""

from __future__ import annotations

import hashlib
import json
import math
import statistics
from collections.abc import Iterable, Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from fsdp_verify.reports.causes import group, signature
from fsdp_verify.reports.schema import SCHEMA_VERSION, as_float, dump, ratio


def case_key(case) -> str:
    """The case without its engine: the same draw run on another engine (a mutant, a new release)
    keeps its key, so `report diff` pairs it across nights."""
    d = case.to_dict()
    d.pop("engine", None)
    return hashlib.sha256(json.dumps(d, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:12]


# A row's own columns, and what every drawn case has of its own (seeds): not knobs.
_NOT_KNOBS = frozenset(
    {"model.kind", "model.factory", "world_size", "mesh_shape", "precision.param_dtype", "steps", "seed", "data_seed"}
    | {"engine"}
)


def case_knobs(case) -> dict[str, Any]:
    """The case's settings that differ from the built-in default case, as dotted field names
    (`precision.reduce_dtype`, `compile`, `tp`, `microbatches`), apart from the row's own columns:
    what a reader of a sweep groups its failures by."""
    from fsdp_verify.case import Case

    def leaves(d: dict, prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in d.items():
            if isinstance(v, dict):
                out.update(leaves(v, f"{prefix}{k}."))
            else:
                out[f"{prefix}{k}"] = v
        return out

    default, mine = leaves(Case().to_dict()), leaves(case.to_dict())
    return {k: v for k, v in mine.items() if k not in _NOT_KNOBS and (k not in default or default[k] != v)}


def first_divergence(verdict) -> str | None:
    f = verdict.first_divergence if verdict is not None else None
    return None if f is None else f"{f.comparator} @ {f.step}/{f.phase} {f.name}"


def ratios_by_comparator(verdict) -> dict[str, dict[str, float | str]]:
    """comparator -> step -> the worst ratio there (numeric records, and failed checks as inf)."""
    out: dict[str, dict[str, float]] = {}
    for f in verdict.findings:
        if f.kind != "deviation" and f.ok:
            continue
        steps = out.setdefault(f.comparator, {})
        steps[str(f.step)] = max(steps.get(str(f.step), 0.0), f.ratio)
    return {c: {s: ratio(r) for s, r in sorted(steps.items(), key=lambda kv: int(kv[0]))} for c, steps in out.items()}


def case_row(
    case,
    verdict,
    seconds: float,
    *,
    index: int | None = None,
    error: str | None = None,
    failed_in: str = "rank failure",
) -> dict[str, Any]:
    """One case: what it was, pass/fail/error, its worst ratio and where, per comparator and step.
    `error`: why it has no verdict, raised in `failed_in` (a rank, or this process)."""
    worst = verdict.worst() if verdict is not None else None
    ok = error is None and verdict is not None and verdict.ok
    return {
        "index": index,
        "case_hash": case.hash,
        "key": case_key(case),
        "ok": ok,
        "status": "error" if error is not None else ("pass" if ok else "fail"),
        "seconds": round(seconds, 3),
        "model": case.model.factory or case.model.kind,
        "world_size": case.world_size,
        "mesh_shape": list(case.mesh_shape) if case.mesh_shape is not None else None,
        "precision": case.precision.param_dtype or "fp32",
        "steps": case.steps,
        "knobs": case_knobs(case),
        "worst_ratio": ratio(worst.ratio) if worst is not None else None,
        "worst_where": f"step {worst.step} {worst.phase} {worst.name}" if worst is not None else None,
        "first_divergence": first_divergence(verdict) if error is None else f"{failed_in}: {error.splitlines()[0]}",
        "summary": (verdict.summary() if verdict is not None else error) if not ok else None,
        **({"hint": verdict.hint} if not ok and verdict is not None and verdict.hint else {}),
        "ratios": ratios_by_comparator(verdict) if verdict is not None else {},
        **(
            {"loss_scale": loss_scale_tally(verdict.loss_scales)} if verdict is not None and verdict.loss_scales else {}
        ),
        **({"zoom": verdict.zoom.to_dict()} if getattr(verdict, "zoom", None) is not None else {}),
    }


def loss_scale_tally(loss_scales: list[dict[str, Any]]) -> dict[str, Any]:
    """A loss-scaled case in a row: its steps, how many the reference skipped, the scales seen
    (so a night shows whether its fp16 cases overflowed at all)."""
    scales = [r["scale"] for r in loss_scales]
    return {
        "steps": len(loss_scales),
        "skipped": sum(r["skipped"] for r in loss_scales),
        "scales": [min(scales), max(scales)],
    }


def loss_scale_line(tallies: list[dict[str, Any]]) -> str | None:
    """`fp16 loss scaling: N cases, S of T steps skipped ...` over the loss-scaled cases' tallies."""
    if not tallies:
        return None
    low, high = min(t["scales"][0] for t in tallies), max(t["scales"][1] for t in tallies)
    return (
        f"fp16 loss scaling: {len(tallies)} cases, {sum(t['skipped'] for t in tallies)} of"
        f" {sum(t['steps'] for t in tallies)} steps skipped by the reference (scales {low:.10g} to {high:.10g})"
    )


def p99(values: Sequence[float]) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(sorted(values), n=100, method="inclusive")[98]


def comparators(rows: Iterable[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per comparator: worst and p99 of each case's worst finite ratio, cases seen, cases failed."""
    per: dict[str, list[float]] = {}
    failed: dict[str, int] = {}
    for row in rows:
        for comp, steps in row["ratios"].items():
            values = [as_float(v) for v in steps.values()]
            finite = [v for v in values if v is not None and math.isfinite(v)]
            per.setdefault(comp, [])
            if finite:
                per[comp].append(max(finite))
            failed[comp] = failed.get(comp, 0) + any(v is not None and v > 1 for v in values)
    return {
        c: {
            "worst": ratio(max(v)) if v else None,
            "p99": ratio(p99(v)),
            "cases": len(v),
            "failed": failed.get(c, 0),
        }
        for c, v in sorted(per.items())
    }


def failures_from_rows(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "case_hash": r["case_hash"],
            "summary": r["summary"] or "",
            "first_divergence": r["first_divergence"],
            **({"replay": r["replay"]} if r.get("replay") else {}),
        }
        for r in rows
        if not r["ok"]
    ]


def finish(
    kind: str,
    rows: list[dict[str, Any]],
    *,
    seconds: float,
    engine: str | None,
    seed: int | None = None,
    shard: str | None = None,
    failures: list[dict[str, Any]] | None = None,
    zoo: list[dict[str, Any]] | None = None,
    ok: bool | None = None,
    environment: dict[str, Any] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """The report every command writes: the common fields first, then the command's own."""
    from fsdp_verify.reports.environment import environment as current_environment

    passed = sum(r["ok"] for r in rows)
    failures = failures_from_rows(rows) if failures is None else failures
    for row in rows:
        cause = signature(row)
        if cause is not None:
            row["cause"] = cause
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": kind,
        "ok": all(r["ok"] for r in rows) if ok is None else ok,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "environment": environment or current_environment(),
        "engine": engine,
        "seed": seed,
        "shard": shard,
        "seconds": round(seconds, 3),
        "counts": {"cases": len(rows), "passed": passed, "failed": len(rows) - passed},
        "cases": rows,
        "comparators": comparators(rows),
        "failures": failures,
        "causes": group(rows, failures),
        "zoo": zoo,
        **extra,
    }


def zoo_rows(results: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The zoo matrix in the report's shape, from selftest's BugResult dicts (or its --json file)."""
    out = []
    for r in results:
        out.append(
            {
                "bug": r["bug"],
                "caught": r["status"] == "caught",
                "status": r["status"],
                "comparator": r.get("comparator") or "",
                "phase": r.get("phase") or "",
                "step": int(r.get("step", -1)),
                "ratio": ratio(as_float(r["ratio"])) if r.get("ratio") is not None else None,
                "examples": int(r.get("examples", 0)),
                "seconds": round(float(r.get("seconds", 0.0)), 3),
            }
        )
    return out


def write(report: dict[str, Any], out_dir: str | Path) -> tuple[Path, Path]:
    """report.json (validated against the schema) and the self-contained report.html."""
    from fsdp_verify.reports.page import render

    out = Path(out_dir)
    json_path = dump(report, out / "report.json")
    html_path = out / "report.html"
    html_path.write_text(render(report))
    return json_path, html_path
