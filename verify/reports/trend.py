"""One page over the last K nights: failing cases and how many causes they have, worst and p99
ratio per comparator, cases per minute, zoo catches, each with the night it last changed, and the
latest night's diff (new causes first). A night is a folder (named so that names sort by date,
e.g. 2026-11-23) holding report.json files."""

from __future__ import annotations

import html
import math
from pathlib import Path
from typing import Any

from fsdp_verify.reports.causes import causes_of
from fsdp_verify.reports.diff import collect, diff, html_section
from fsdp_verify.reports.page import page
from fsdp_verify.reports.plots import line_chart
from fsdp_verify.reports.schema import ReportError, as_float


def nights(nights_dir: str | Path, last: int) -> list[Path]:
    """The last `last` night folders (those with a report.json below them), oldest first."""
    root = Path(nights_dir)
    if not root.is_dir():
        raise ReportError(f"{nights_dir}: not a folder of nights")
    found = sorted(d for d in root.iterdir() if d.is_dir() and any(d.rglob("report.json")))
    if not found:
        raise ReportError(f"{nights_dir}: no night folder with a report.json")
    return found[-last:]


def metrics(night: Path) -> dict[str, Any]:
    """One night in numbers (over all its reports)."""
    reports = collect(night).values()
    runs = [r for r in reports if r["kind"] in ("sweep", "fuzz", "check")]
    cases = sum(r["counts"]["cases"] for r in runs)
    seconds = sum(r["seconds"] for r in runs)
    comps: dict[str, dict[str, float | None]] = {}
    for r in runs:
        for name, s in r["comparators"].items():
            cur = comps.setdefault(name, {"worst": None, "p99": None})
            for stat in ("worst", "p99"):
                v = as_float(s[stat])
                if v is not None and (cur[stat] is None or v > cur[stat]):
                    cur[stat] = v
    zoo: dict[str, bool] = {}
    for r in reports:
        for z in r["zoo"] or []:
            zoo[z["bug"]] = zoo.get(z["bug"], False) or z["caught"]
    return {
        "night": night.name,
        "failures": sum(r["counts"]["failed"] for r in runs),
        "causes": len({c["signature"] for r in runs for c in causes_of(r)}),
        "cases": cases,
        "cases_per_minute": cases / seconds * 60 if seconds > 0 else None,
        "comparators": comps,
        "zoo_caught": sum(zoo.values()) if zoo else None,
        "zoo_total": len(zoo) if zoo else None,
    }


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return "inf" if math.isinf(v) else f"{v:.3g}"
    return str(v)


def render(nights_dir: str | Path, last: int = 14) -> str:
    folders = nights(nights_dir, last)
    rows = [metrics(n) for n in folders]
    labels = [r["night"] for r in rows]
    comps = sorted({c for r in rows for c in r["comparators"]})
    columns: list[tuple[str, Any]] = [
        ("failing cases", lambda r: r["failures"]),
        ("their causes", lambda r: r["causes"]),
        ("cases", lambda r: r["cases"]),
        ("cases/min", lambda r: None if r["cases_per_minute"] is None else round(r["cases_per_minute"], 1)),
        ("zoo caught", lambda r: None if r["zoo_total"] is None else f"{r['zoo_caught']}/{r['zoo_total']}"),
    ]
    for c in comps:
        for stat in ("worst", "p99"):
            columns.append((f"{c} {stat}", lambda r, c=c, stat=stat: r["comparators"].get(c, {}).get(stat)))
    # a row per number, a column per night: K nights stay readable, however many comparators
    table_rows = []
    for name, get in columns:
        values = [_fmt(get(r)) for r in rows]
        changed_on = "never"
        tds = []
        for i, v in enumerate(values):
            changed = i > 0 and v != values[i - 1]
            changed_on = rows[i]["night"] if changed else changed_on
            tds.append(f"<td{' class=changed' if changed else ''}>{html.escape(v)}</td>")
        table_rows.append(f"<tr><th>{html.escape(name)}</th>{''.join(tds)}<td>{html.escape(changed_on)}</td></tr>")
    head = "".join(f"<th>{html.escape(n)}</th>" for n in labels)
    failures = {
        "failing cases": [(i, r["failures"]) for i, r in enumerate(rows)],
        "their causes": [(i, r["causes"]) for i, r in enumerate(rows)],
    }
    plots = [
        "<h2>Failing cases and their causes</h2>",
        line_chart(failures, labels, name="trend-failures", log=False, threshold=None),
        "<h2>Cases per minute</h2>",
        line_chart(
            {"cases/min": [(i, r["cases_per_minute"]) for i, r in enumerate(rows)]},
            labels,
            name="trend-speed",
            log=False,
            threshold=None,
        ),
    ]
    for stat in ("worst", "p99"):
        series = {c: [(i, r["comparators"].get(c, {}).get(stat)) for i, r in enumerate(rows)] for c in comps}
        plots += [f"<h2>{stat} ratio per comparator</h2>", line_chart(series, labels, name=f"trend-{stat}")]
    if any(r["zoo_total"] for r in rows):
        zoo = {"caught": [(i, r["zoo_caught"]) for i, r in enumerate(rows)]}
        zoo["bugs"] = [(i, r["zoo_total"]) for i, r in enumerate(rows)]
        plots += ["<h2>Zoo catches</h2>", line_chart(zoo, labels, name="trend-zoo", log=False, threshold=None)]
    latest = ""
    if len(folders) > 1:
        latest = html_section(diff(folders[-2], folders[-1]))
    body = (
        f"<h1 id=status>fsdp-verify nightly trend: {len(rows)} nights, {html.escape(labels[0])} to "
        f"{html.escape(labels[-1])}</h1>{latest}"
        "<style>td.changed{background:#fff3cd;font-weight:bold}</style>"
        f"<h2>Per night</h2><p>Highlighted: changed since the night before; the last column names the night"
        f" each number last changed.</p><table id=trend><tr><th></th>{head}<th>last changed</th></tr>"
        f"{''.join(table_rows)}</table>{''.join(plots)}"
    )
    return page("fsdp-verify nightly trend", body)
