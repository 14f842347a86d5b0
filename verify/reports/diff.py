"""What changed between two nights (or any two reports of the same kind), for a morning reader:
new and fixed failures, cases whose status or first divergence moved, comparators whose worst or
p99 ratio moved by more than a factor, zoo bugs no longer caught, and the environment that changed.
deepdiff finds the differences; this module says which of them made things worse."""

from __future__ import annotations

import html
import math
from pathlib import Path
from typing import Any

from deepdiff import DeepDiff

from fsdp_verify.reports.causes import causes_of, heading, signature
from fsdp_verify.reports.schema import ReportError, as_float, load

FLOOR = 1e-6  # ratios below this count as exact when comparing by a factor


def collect(path: str | Path) -> dict[str, dict[str, Any]]:
    """Reports under `path` by their place: a report.json (or a folder holding one) is "."; a
    night's folder gives each report.json below it by its relative folder (sweep, zoo, ...)."""
    p = Path(path)
    if p.is_file() or (p / "report.json").is_file():
        return {".": load(p)}
    if not p.is_dir():
        raise ReportError(f"{path}: no such report or folder")
    found = {str(f.parent.relative_to(p)): load(f) for f in sorted(p.rglob("report.json"))}
    if not found:
        raise ReportError(f"{path}: no report.json in this folder or below it")
    return found


def _cases(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r["key"]: {"status": r["status"], "first_divergence": r["first_divergence"]} for r in report["cases"]}


def _cause_entries(report: dict[str, Any], keep, keys: list[str] | None = None) -> list[dict[str, Any]]:
    """The report's causes for which `keep(signature)` holds, each with its smallest case and replay;
    `cases`: how many of its cases are among `keys` (all of them when None)."""
    cause_of = {r["key"]: signature(r) for r in report["cases"]}
    first = {r["case_hash"]: r["first_divergence"] for r in report["cases"]}
    out = []
    for c in causes_of(report):
        if not keep(c["signature"]):
            continue
        mine = [k for k, cause in cause_of.items() if cause == c["signature"] and (keys is None or k in keys)]
        if mine:
            entry = {
                "signature": c["signature"],
                "example": heading(c, report["cases"]),
                "cases": len(mine),
                "keys": mine,
            }
            smallest = {
                "smallest": c["smallest"],
                "first_divergence": first.get(c["smallest"]),
                "replay": c.get("replay"),
            }
            out.append(entry | smallest)
    return out


def _deepdiff(old: dict[str, Any], new: dict[str, Any]) -> DeepDiff:
    """Per key, always: by default deepdiff (8.1+) reports two dicts that share under a third of
    their keys as one change of the whole root, with no key to name (two nights of four cases
    each, one under a mutant engine, did exactly that)."""
    return DeepDiff(old, new, view="tree", threshold_to_diff_deeper=0)


def _moved(old: float | None, new: float | None, factor: float) -> float | None:
    if old is None or new is None:
        return None
    a, b = max(old, FLOOR), max(new, FLOOR)
    if math.isinf(a) or math.isinf(b):
        return None if a == b else (math.inf if math.isinf(b) else 0.0)
    r = b / a
    return r if (r > factor or r < 1 / factor) else None


def diff_reports(old: dict[str, Any], new: dict[str, Any], factor: float) -> dict[str, Any]:
    """The changes between two reports of one place; `worse` lists what got worse."""
    out: dict[str, Any] = {
        "new_failures": [],
        "fixed_failures": [],
        "changed_cases": [],
        "ratios_moved": [],
        "zoo_lost": [],
        "zoo_gained": [],
        "environment": {},
    }
    oc, nc = _cases(old), _cases(new)
    dd = _deepdiff(oc, nc)
    for kind in ("dictionary_item_added", "values_changed", "dictionary_item_removed"):
        for change in dd.get(kind, []):
            key = change.path(output_format="list")[0]
            before, after = oc.get(key), nc.get(key)
            if after is not None and after["status"] != "pass" and (before is None or before["status"] == "pass"):
                out["new_failures"].append({"key": key, **after})
            elif before is not None and after is not None and before["status"] != "pass" and after["status"] == "pass":
                out["fixed_failures"].append({"key": key, **before})
            elif before is not None and after is not None:
                out["changed_cases"].append({"key": key, "old": before, "new": after})
    # one entry per case even if deepdiff reported both its fields
    for name in ("new_failures", "fixed_failures", "changed_cases"):
        out[name] = list({e["key"]: e for e in out[name]}.values())
    # A nightly that turns red by one bug fails many cases: what got worse is said a cause at a
    # time (verify/reports/causes.py): causes the old report did not have, and new failures of
    # causes it had; and what got better, causes gone.
    known = {c["signature"] for c in causes_of(old)}
    now = {c["signature"] for c in causes_of(new)}
    newly = [e["key"] for e in out["new_failures"]]
    out["new_causes"] = _cause_entries(new, lambda c: c not in known)
    out["known_causes_new_failures"] = _cause_entries(new, lambda c: c in known, newly)
    out["gone_causes"] = _cause_entries(old, lambda c: c not in now)
    was, became = ({r["key"]: signature(r) for r in report["cases"]} for report in (old, new))
    moved: dict[tuple, int] = {}
    for e in out["changed_cases"]:
        pair = (was.get(e["key"]), became.get(e["key"]))
        moved[pair] = moved.get(pair, 0) + 1
    out["changed_by_cause"] = [{"old": a, "new": b, "cases": n} for (a, b), n in moved.items()]
    for comp in sorted(set(old["comparators"]) | set(new["comparators"])):
        o, n = old["comparators"].get(comp), new["comparators"].get(comp)
        for stat in ("worst", "p99"):
            a = as_float(o[stat]) if o else None
            b = as_float(n[stat]) if n else None
            moved = _moved(a, b, factor)
            if moved is not None:
                out["ratios_moved"].append({"comparator": comp, "stat": stat, "old": a, "new": b, "by": moved})
    ozoo = {z["bug"]: z["caught"] for z in old["zoo"] or []}
    nzoo = {z["bug"]: z["caught"] for z in new["zoo"] or []}
    out["zoo_lost"] = sorted(b for b, caught in ozoo.items() if caught and not nzoo.get(b, False) and b in nzoo)
    out["zoo_gained"] = sorted(b for b, caught in nzoo.items() if caught and not ozoo.get(b, True))
    env = _deepdiff(old["environment"], new["environment"])
    for change in env.get("values_changed", []):
        field = change.path(output_format="list")[0]
        out["environment"][field] = {"old": change.t1, "new": change.t2}
    out["only_in_old"] = sorted(set(oc) - set(nc))
    out["only_in_new"] = sorted(set(nc) - set(oc))
    out["missing_shards"] = new.get("missing_shards") or []
    out["worse"] = (
        [f"missing shards {', '.join(out['missing_shards'])}"] * bool(out["missing_shards"])
        + [f"new cause ({_count(c['cases'])}): {c['example']}" for c in out["new_causes"]]
        + [
            f"{_count(c['cases'], 'more failing case')} of a known cause: {c['example']}"
            for c in out["known_causes_new_failures"]
        ]
        + [
            f"{e['comparator']} {e['stat']} ratio {_num(e['old'])} -> {_num(e['new'])}"
            for e in out["ratios_moved"]
            if e["by"] > 1
        ]
        + [f"zoo bug no longer caught: {b}" for b in out["zoo_lost"]]
    )
    return out


def diff(old_path: str | Path, new_path: str | Path, factor: float = 2.0) -> dict[str, Any]:
    """Every place's diff; a report gone from NEW is worse, one new in NEW is noted."""
    old, new = collect(old_path), collect(new_path)
    places = {}
    for place in sorted(set(old) | set(new)):
        if place not in new:
            places[place] = {"missing_in_new": True, "worse": [f"report {place} missing in {new_path}"]}
        elif place not in old:
            places[place] = {"new_report": True, "worse": []}
        else:
            places[place] = diff_reports(old[place], new[place], factor)
    worse = [f"{p}: {w}" if p != "." else w for p, d in places.items() for w in d["worse"]]
    changed = any(_changed(d) for d in places.values()) or bool(worse)
    return {
        "old": str(old_path),
        "new": str(new_path),
        "factor": factor,
        "places": places,
        "worse": worse,
        "changed": changed,
    }


def _changed(d: dict[str, Any]) -> bool:
    return bool(d.get("missing_in_new") or d.get("new_report")) or any(
        d.get(k)
        for k in (
            "new_failures",
            "fixed_failures",
            "changed_cases",
            "new_causes",
            "gone_causes",
            "ratios_moved",
            "zoo_lost",
            "zoo_gained",
            "environment",
            "missing_shards",
            "only_in_old",
            "only_in_new",
        )
    )


def _count(n: int, what: str = "case", plural: str | None = None) -> str:
    return f"{n} {what if n == 1 else plural or what + 's'}"


def _num(v: float | None) -> str:
    return "-" if v is None else ("inf" if math.isinf(v) else f"{v:.3g}")


def text(result: dict[str, Any]) -> str:
    """The terminal summary; 'no change' when nothing differs."""
    if not result["changed"]:
        return f"no change between {result['old']} and {result['new']}"
    lines = [f"report diff {result['old']} -> {result['new']} (ratios compared by a factor of {result['factor']:g})"]
    for place, d in result["places"].items():
        if not _changed(d):
            continue
        lines.append(f"[{place}]")
        if d.get("missing_in_new"):
            lines.append("  report missing in NEW")
            continue
        if d.get("new_report"):
            lines.append("  new report (not in OLD)")
            continue
        if d["missing_shards"]:
            lines.append(f"  MISSING SHARDS in NEW: {', '.join(d['missing_shards'])}")
        if d["only_in_old"] or d["only_in_new"]:
            lines.append(f"  cases only in OLD: {len(d['only_in_old'])}, only in NEW: {len(d['only_in_new'])}")
        lines += _failures_text(d)
        for c in d["changed_by_cause"]:
            lines.append(f"  changed [{_count(c['cases'])}]: {c['old'] or 'pass'} -> {c['new'] or 'pass'}")
        for e in d["ratios_moved"]:
            how = "UP" if e["by"] > 1 else "down"
            lines.append(f"  {e['comparator']} {e['stat']} ratio {how}: {_num(e['old'])} -> {_num(e['new'])}")
        for b in d["zoo_lost"]:
            lines.append(f"  ZOO BUG NO LONGER CAUGHT: {b}")
        for b in d["zoo_gained"]:
            lines.append(f"  zoo bug now caught: {b}")
        for field, ch in d["environment"].items():
            lines.append(f"  environment {field}: {ch['old']} -> {ch['new']}")
    lines.append(_verdict_line(result))
    return "\n".join(lines)


def _failures_text(d: dict[str, Any]) -> list[str]:
    """Failures a cause a line (each case's key is in --json): new causes, new failures of known
    causes, causes gone."""
    lines = []
    for c in d["new_causes"]:
        lines.append(f"  NEW CAUSE [{_count(c['cases'])}]: {c['example']}")
        lines.append(f"      smallest {c['smallest']}, first divergence {c['first_divergence'] or '-'}")
        if c["replay"]:
            lines.append(f"      replay: {c['replay']}")
    for c in d["known_causes_new_failures"]:
        lines.append(f"  NEW FAILURES [{_count(c['cases'])}] of a known cause: {c['example']}")
    for c in d["gone_causes"]:
        lines.append(f"  fixed cause [{_count(c['cases'])}]: {c['example']}")
    if d["fixed_failures"]:
        lines.append(f"  fixed: {_count(len(d['fixed_failures']))} pass now")
    return lines


def _verdict_line(result: dict[str, Any]) -> str:
    """`WORSE: 2 new causes (37 newly failing cases), 4 ratios up, ...` or `nothing got worse`."""
    if not result["worse"]:
        return "nothing got worse"
    places = [d for d in result["places"].values() if "new_failures" in d]
    failing = sum(len(d["new_failures"]) for d in places)
    counts = [
        (sum(len(d["new_causes"]) for d in places), "new cause", None),
        (sum(e["by"] > 1 for d in places for e in d["ratios_moved"]), "ratio up", "ratios up"),
        (sum(len(d["zoo_lost"]) for d in places), "zoo bug lost", "zoo bugs lost"),
        (sum(bool(d["missing_shards"]) for d in places), "report missing shards", "reports missing shards"),
        (sum(bool(d.get("missing_in_new")) for d in result["places"].values()), "report gone", "reports gone"),
    ]
    parts = [_count(*c) for c in counts if c[0] or (c[1] == "new cause" and failing)]
    if failing:
        parts[0] += f" ({_count(failing, 'newly failing case')})"
    return "WORSE: " + ", ".join(parts)


def html_section(result: dict[str, Any]) -> str:
    """The diff as an HTML section (in the diff page, and in a night's trend page)."""
    body = html.escape(text(result))
    cls = "failures" if result["worse"] else ""
    title = "What got worse since the previous night" if result["worse"] else "Changes since the previous night"
    return f'<section id="diff" class="{cls}"><h2>{title}</h2><pre>{body}</pre></section>'
