"""Shards' sweep reports made one: every case once (keyed by its index in the seed's draw),
counts recomputed from the cases, and any shard not given named as missing. Shards that disagree
on the seed, the shard count, the engine or the draw are refused: they are not one sweep."""

from __future__ import annotations

from typing import Any

from fsdp_verify.reports.report import finish
from fsdp_verify.reports.schema import ReportError

SAME = ("kind", "seed", "engine", "planned_cases", "draw")


def _shard(report: dict[str, Any], where: str) -> tuple[int, int]:
    if report["kind"] != "sweep" or not report["shard"]:
        raise ReportError(f"{where}: shard: expected a sweep shard's report (shard I/N), got kind {report['kind']!r}")
    i, n = (int(x) for x in report["shard"].split("/"))
    return i, n


def merge(reports: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """One sweep report from its shards' (where, report) pairs."""
    if not reports:
        raise ReportError("no reports to merge")
    first_where, first = reports[0]
    _, n = _shard(first, first_where)
    seen: dict[int, str] = {}
    by_index: dict[int, tuple[str, dict]] = {}
    for where, r in reports:
        i, m = _shard(r, where)
        for field in SAME:
            if r.get(field) != first.get(field):
                raise ReportError(
                    f"{where}: {field}: {r.get(field)!r} differs from {first_where}'s {first.get(field)!r}"
                    " (not shards of one sweep)"
                )
        for tool in ("hypothesis", "fsdp_verify"):  # another version may draw other cases for one seed
            if r["environment"].get(tool) != first["environment"].get(tool):
                raise ReportError(
                    f"{where}: environment.{tool}: {r['environment'].get(tool)!r} differs from {first_where}'s"
                    f" {first['environment'].get(tool)!r} (shards must draw with the same versions)"
                )
        if m != n:
            raise ReportError(f"{where}: shard: {r['shard']} is not one of {n} shards like {first_where}'s")
        if i in seen:
            raise ReportError(f"{where}: shard: {r['shard']} given twice (also {seen[i]})")
        seen[i] = where
        for row in r["cases"]:
            k = row["index"]
            if k is None or k % n != i - 1:
                raise ReportError(f"{where}: cases: case index {k} does not belong to shard {r['shard']}")
            by_index[k] = (where, row)
    missing = [f"{i}/{n}" for i in range(1, n + 1) if i not in seen]
    rows = [by_index[k][1] for k in sorted(by_index)]
    zoo = next((r["zoo"] for _, r in reports if r["zoo"]), None)
    return finish(
        "sweep",
        rows,
        seconds=sum(r["seconds"] for _, r in reports),
        engine=first["engine"],
        seed=first["seed"],
        shard=None,
        zoo=zoo,
        ok=all(row["ok"] for row in rows) and not missing,
        environment=first["environment"],
        planned_cases=first.get("planned_cases"),
        draw=first.get("draw"),
        shards=[f"{i}/{n}" for i in sorted(seen)],
        missing_shards=missing,
        wall_seconds=max(r["seconds"] for _, r in reports),
        **({"engine_correct": first["engine_correct"]} if "engine_correct" in first else {}),
        **({"warnings": _warnings(r for _, r in reports)} if any("warnings" in r for _, r in reports) else {}),
    )


def _warnings(reports) -> list[dict]:
    """The shards' library warnings, each once with the counts added."""
    from fsdp_verify.library_warnings import Tally

    tally = Tally()
    for r in reports:
        tally.merge(r.get("warnings") or [])
    return tally.entries()
