"""A zoom on a page (docs/zoom.md): the chain, the module tree with a heat map of each module's
worst forward and backward ratio (an SVG, the named module outlined), and the op table of the
named module, the parting op marked."""

from __future__ import annotations

import html
import math
from typing import Any

from fsdp_verify.reports.schema import as_float


def _colour(value: Any, ok: bool) -> str:
    """Light green (exact) to orange (at the tolerance); red past it."""
    r = as_float(value) if value is not None else 0.0
    if not ok and (r is None or r > 1 or math.isinf(r)):
        return "#e34a33"
    if not r:
        return "#c7e9c0"
    shade = min(1.0, max(0.0, (math.log10(r) + 6) / 6))
    return f"rgb(255,{int(233 - 120 * shade)},{int(192 - 150 * shade)})"


def _text(value: Any) -> str:
    r = as_float(value) if value is not None else None
    return "-" if r is None else ("inf" if math.isinf(r) else ("exact" if r == 0 else f"{r:.2g}"))


def module_tree(zoom: dict[str, Any]) -> str:
    """One row per module, indented by depth; two cells: forward and backward ratio."""
    rows = zoom.get("modules") or []
    if not rows:
        return ""
    x_cells, cell_w, row_h, width = 380, 90, 18, 580
    height = 24 + row_h * len(rows)
    parts = [
        f'<svg class="plot" data-plot="zoom-modules" width="{width}" height="{height}" '
        'xmlns="http://www.w3.org/2000/svg" font-size="11">',
        f'<text x="{x_cells + 20}" y="14">forward</text><text x="{x_cells + cell_w + 14}" y="14">backward</text>',
    ]
    names = {row["module"] for row in rows}
    for i, row in enumerate(rows):
        y = 20 + i * row_h
        fqn = row["module"]
        depth = 0 if fqn == "" else fqn.count(".") + 1
        named = zoom.get("module") == fqn
        parent = fqn.rsplit(".", 1)[0] if "." in fqn else ""
        # A module's own name under its parent; the whole path where the parent never ran (a ModuleList).
        label = html.escape(fqn.rsplit(".", 1)[-1] if parent in names else fqn) if fqn else "(root)"
        weight = ' font-weight="bold"' if named else ""
        parts.append(f'<text x="{6 + 14 * depth}" y="{y + 13}"{weight}>{label}</text>')
        for j, col in enumerate(("forward", "backward")):
            value = row[col]
            ok = row["ok"] or (as_float(value) or 0) <= 1
            stroke = ' stroke="#000" stroke-width="2"' if named and zoom.get("direction") == col else ""
            parts.append(
                f'<rect class="cell" x="{x_cells + j * cell_w}" y="{y}" width="{cell_w - 4}" height="{row_h - 2}"'
                f' fill="{_colour(value, ok)}"{stroke}><title>{html.escape(fqn or "(root)")} {col}: '
                f"{_text(value)}</title></rect>"
                f'<text x="{x_cells + j * cell_w + 6}" y="{y + 12}">{_text(value)}</text>'
            )
    parts.append("</svg>")
    return "".join(parts)


def op_table(zoom: dict[str, Any]) -> str:
    ops = zoom.get("ops") or []
    if not ops:
        return ""
    rows = "".join(
        f"<tr class={'bad' if not o['ok'] else 'ok'}><td>{o['index']}</td><td>{html.escape(o['op'])}</td>"
        f"<td>{_text(o['ratio'])}</td><td>{html.escape(o['where'])}</td></tr>"
        for o in ops
    )
    return f"<table id=zoom-ops><tr><th>#</th><th>op</th><th>ratio</th><th>where</th></tr>{rows}</table>"


def zoom_section(zoom: dict[str, Any] | None) -> str:
    """The page's zoom part; empty when no zoom ran."""
    if zoom is None:
        return ""
    saved = (
        f"<p>The op's inputs and outputs: <code>{html.escape(zoom['saved'])}</code></p>" if zoom.get("saved") else ""
    )
    return (
        f"<h2>Zoom</h2><p id=zoom-chain>{html.escape(zoom['chain'])}</p><p>{html.escape(zoom['why'])}</p>{saved}"
        "<h3>Modules: worst ratio of each module's outputs and gradients (below 1 passes)</h3>"
        f"{module_tree(zoom)}<h3>Operations inside the named module</h3>{op_table(zoom)}"
    )
