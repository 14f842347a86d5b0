"""Failures grouped by cause: many failing cases usually share a few bugs, and a reader wants each
bug once (its count, its smallest case, the command that replays it), not a paragraph per case.

A cause is a failing row's signature, read from the row's own text (so reports written before
this module group too): for a divergence, the phase and the comparator of the first failing
record and the hint; for a rank failure, its kind (crash, error, hang), the phase the rank was in
and the error's class and message. Numbers (steps, ranks, micro-batches, ratios, sizes) and case
hashes are normalised away, since they vary within one cause (a world size of 2 or 3 gives a
gradient 1/2 or 1/3 off); the record's name is left out of the signature and listed beside it
(the first parameter to part is whichever the model has first). The signature only groups: a
cause is headed by one member's own words (its smallest case's, `example`: "1/2 x ... (the world
size: 2)"), never by the placeholders. This is coarser than a person's
judgement and finer than `fsdp-verify shrink`'s "fails the same way" (verify/repro/shrink.py),
which keeps only the comparator and phase."""

from __future__ import annotations

import html
import json
import re
from collections import Counter
from typing import Any

from fsdp_verify.verdict import PHASE_TITLES

_FIRST = re.compile(r"^(?P<comparator>\S+) @ -?\d+/(?P<phase>\S+) (?P<name>.*)$")
_RANK = re.compile(r"rank \d+ (?P<kind>crash|error|hang|start) in phase '(?P<phase>[^']*)': (?P<detail>.*)")
_RANK_FAILED = {
    "crash": "a rank crashed",
    "error": "a rank raised",
    "hang": "a rank hung",
    "start": "a rank failed to start",
}
_OTHERS = re.compile(r" \(others: .*\)$")
_HASH = re.compile(r"\b[0-9a-f]{12}\b")
_NUMBER = re.compile(r"(?<![A-Za-z0-9_])[-+]?(\d+(\.\d+)?|\.\d+)([eE][-+]?\d+)?")
_HINT = re.compile(r" Hint: (?P<hint>.*?)(?= Note: |$)", re.S)
_ERROR_CLASS = re.compile(r"^(?P<cls>[A-Za-z_][\w.]*(Error|Exception|Failure|Interrupt|Exit)\w*): ?(?P<message>.*)$")


def normalise(text: str) -> str:
    """Case hashes and numbers replaced by placeholders: what varies within one cause."""
    return _NUMBER.sub("#", _HASH.sub("<case>", text)).strip()


def hint_of(row: dict[str, Any]) -> str:
    """The verdict's hint: the row's own field, else the `Hint:` sentence of its summary."""
    if row.get("hint"):
        return row["hint"]
    found = _HINT.search(row.get("summary") or "")
    return found.group("hint").strip() if found else ""


def _rank_failure(row: dict[str, Any]) -> re.Match | None:
    for text in (row.get("first_divergence") or "", row.get("summary") or ""):
        found = _RANK.search(text.splitlines()[0] if text else "")
        if found:
            return found
    return None


def _error_class(detail: str, norm=None) -> str:
    """`RuntimeError: message` -> `RuntimeError: message` normalised; a crash's or a hang's
    detail normalised (a signal's number kept: it names how the process died). `norm`: another
    normalisation (the identity: a member's own words)."""
    norm = norm or normalise
    first = detail.strip().splitlines()[0] if detail.strip() else ""
    first = _OTHERS.sub("", first)  # where the other ranks were: it varies within one cause
    if first.startswith("process "):  # "process killed by signal 6", "process exited with code 7"
        return first
    found = _ERROR_CLASS.match(first)
    if found:
        message = norm(found.group("message"))
        return f"{found.group('cls')}: {message[:160]}" if message else found.group("cls")
    return norm(first)[:160]


def signature(row: dict[str, Any]) -> str | None:
    """The row's cause as one line, numbers and hashes normalised: what groups rows; None for a
    passing row."""
    return _cause(row, normalise)


def example(row: dict[str, Any]) -> str | None:
    """The row's cause in its own words (its numbers kept: "1/2 x ... (the world size: 2)"), the
    line that heads a cause; None for a passing row."""
    return _cause(row, str.strip)


def _cause(row: dict[str, Any], norm) -> str | None:
    if row.get("ok"):
        return None
    failure = _rank_failure(row) if row.get("status") == "error" else None
    if failure is not None:
        phase = norm(failure.group("phase"))
        return f"{_RANK_FAILED[failure.group('kind')]} in {phase}: {_error_class(failure.group('detail'), norm)}"
    first = _FIRST.match(row.get("first_divergence") or "")
    hint = norm(hint_of(row))
    if first is None:
        text = row.get("first_divergence") or (row.get("summary") or "").split(". ", 1)[0] or "failed"
        return norm(text) + (f"; hint: {hint}" if hint else "")
    phase = first.group("phase")
    head = f"{PHASE_TITLES.get(phase, phase)} ({first.group('comparator')})"
    return f"{head}: {hint}" if hint else head


def record_name(row: dict[str, Any]) -> str | None:
    first = _FIRST.match(row.get("first_divergence") or "")
    return first.group("name") if first else None


def _size(row: dict[str, Any]) -> tuple:
    """How big a failing case is, smallest first: world size, steps, the Case's JSON (where the
    row has it), then its time."""
    case = row.get("case")
    return (
        row.get("world_size") or 0,
        row.get("steps") or 0,
        len(json.dumps(case, sort_keys=True)) if case else 0,
        row.get("seconds") or 0.0,
    )


def group(rows: list[dict[str, Any]], failures: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The causes of the failing rows, the most cases first. Each: its signature (what groups
    them), its smallest member's own words (what heads it), how many cases,
    their hashes, the smallest case (the one a search shrank, where a failure entry names it)
    and the command that replays it, and the names of the records that parted first."""
    replays = {f["case_hash"]: f.get("replay") for f in failures or [] if f.get("replay")}
    shrunk = {f["case_hash"] for f in failures or [] if f.get("case")}
    by_cause: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        cause = signature(row)
        if cause is not None:
            by_cause.setdefault(cause, []).append(row)
    out = []
    for cause, members in by_cause.items():
        smallest = min(members, key=lambda r: (r["case_hash"] not in shrunk, _size(r)))
        replay = smallest.get("replay") or replays.get(smallest["case_hash"])
        names = Counter(n for n in map(record_name, members) if n is not None)
        out.append(
            {
                "signature": cause,
                "example": example(smallest),
                "count": len(members),
                "cases": list(dict.fromkeys(r["case_hash"] for r in members)),
                "smallest": smallest["case_hash"],
                "replay": replay,
                "names": dict(names.most_common()),
            }
        )
    order = {cause: i for i, cause in enumerate(by_cause)}
    return sorted(out, key=lambda c: (-c["count"], order[c["signature"]]))


def causes_of(report: dict[str, Any]) -> list[dict[str, Any]]:
    """A report's causes: its own field, or grouped from its rows (a report written before it)."""
    if report.get("causes") is not None:
        return report["causes"]
    return group(report["cases"], report.get("failures"))


def heading(cause: dict[str, Any], rows: list[dict[str, Any]]) -> str:
    """What heads a cause: its smallest member's own words (from the row where a report written
    before them lacks the field), else the signature."""
    if cause.get("example"):
        return cause["example"]
    row = next((r for r in rows if r["case_hash"] == cause["smallest"]), None)
    return (example(row) if row is not None else None) or cause["signature"]


def _described(row: dict[str, Any] | None) -> str:
    if row is None:
        return ""
    parts = [f"world size {row['world_size']}" if row.get("world_size") else ""]
    parts.append(str(row.get("precision") or ""))
    parts.append(f"{row['steps']} step{'' if row['steps'] == 1 else 's'}" if row.get("steps") else "")
    return ", ".join(p for p in parts if p)


def _names_text(names: dict[str, int], limit: int = 4) -> str:
    items = list(names.items())
    text = ", ".join(f"{n!r} ({k})" if len(items) > 1 else repr(n) for n, k in items[:limit])
    return text + (f" and {len(items) - limit} more" if len(items) > limit else "")


def text(causes: list[dict[str, Any]], rows: list[dict[str, Any]], indent: str = "  ") -> str:
    """The terminal lines: a cause a paragraph, its count first."""
    by_hash = {r["case_hash"]: r for r in rows}
    lines = []
    for c in causes:
        small = by_hash.get(c["smallest"])
        lines.append(f"{indent}[{c['count']} case{'' if c['count'] == 1 else 's'}] {heading(c, rows)}")
        where = f" at {_names_text(c['names'])}" if c["names"] else ""
        lines.append(f"{indent}    smallest: {c['smallest']} ({_described(small)}){where}")
        if c.get("replay"):
            lines.append(f"{indent}    replay: {c['replay']}")
    return "\n".join(lines)


def headline(causes: list[dict[str, Any]]) -> str:
    n = sum(c["count"] for c in causes)
    return f"{n} failing case{'' if n == 1 else 's'}, {len(causes)} cause{'' if len(causes) == 1 else 's'}"


def html_section(causes: list[dict[str, Any]], rows: list[dict[str, Any]], failures: list[dict[str, Any]]) -> str:
    """Each cause once: its count and its smallest member's words (the signature as the heading's
    title), the smallest case with its first divergence, the
    replay command and zoom where there are, and every member's summary (tracebacks included)
    folded under <details>."""
    e = html.escape
    by_hash = {r["case_hash"]: r for r in rows}
    entries = {f["case_hash"]: f for f in failures}
    items = [f'<p id="causes-headline"><b>{e(headline(causes))}</b></p>']
    for i, c in enumerate(causes):
        small = by_hash.get(c["smallest"], {})
        entry = entries.get(c["smallest"], {})
        first = entry.get("first_divergence") or small.get("first_divergence") or "-"
        where = f" Names: {e(_names_text(c['names']))}." if c["names"] else ""
        replay = f"<p>Replay: <code>{e(c['replay'])}</code></p>" if c.get("replay") else ""
        zoom = f"<p>Zoom: <code>{e(entry['zoom'])}</code></p>" if entry.get("zoom") else ""
        case = ""
        if entry.get("case"):
            dumped = json.dumps(entry["case"], indent=2, sort_keys=True)
            case = f"<details><summary>Case {e(c['smallest'])}</summary><pre>{e(dumped)}</pre></details>"
        members = "\n\n".join(
            f"{h}: {(entries.get(h) or by_hash.get(h) or {}).get('summary') or ''}" for h in c["cases"]
        )
        plural = "" if c["count"] == 1 else "s"
        items.append(
            f'<div class="cause" id="cause-{i + 1}" data-count="{c["count"]}">'
            f'<h3 title="{e(c["signature"])}">{c["count"]} case{plural}: {e(heading(c, rows))}</h3>'
            f"<p>Smallest: <b>{e(c['smallest'])}</b> ({e(_described(small))}). First divergence:"
            f" <code>{e(first)}</code>.{where}</p>{zoom}{replay}{case}"
            f"<details class=members><summary>Summaries and tracebacks ({c['count']})</summary>"
            f"<pre>{e(members)}</pre></details></div>"
        )
    return "".join(items)
