"""Inline SVG plots made in Python, so a report page needs no network, script or CDN. Every plot
is an <svg class="plot" data-plot=NAME>, which the browser tests look for."""

from __future__ import annotations

import html
import math
from collections.abc import Sequence

COLOURS = ("#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02", "#a6761d", "#666666", "#1f78b4")
RED, BLUE, GREEN, GREY = "#c0392b", "#2e86c1", "#1e8449", "#999999"
# Histogram bins of log10(worst deviation / tolerance); exact agreement (ratio 0) gets its own.
BIN_EDGES = (-6, -5, -4, -3, -2, -1, 0, 1, 2)


def _open(name: str, width: int, height: int) -> str:
    return (
        f'<svg class="plot" data-plot="{name}" xmlns="http://www.w3.org/2000/svg" width="{width}" '
        f'height="{height}" font-family="sans-serif" font-size="11" role="img">'
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="#fcfcfc" stroke="#ddd"/>'
    )


def histogram(ratios: Sequence[float]) -> list[tuple[str, int]]:
    """(label, count) per bin of log10(ratio); ratio 0 is 'exact', >= 1 means over tolerance."""
    labels = ["exact", f"<1e{BIN_EDGES[0]}"]
    labels += [f"1e{a}..1e{b}" for a, b in zip(BIN_EDGES, BIN_EDGES[1:])]
    labels.append(f">=1e{BIN_EDGES[-1]}")
    counts = [0] * len(labels)
    for r in ratios:
        if r == 0:
            counts[0] += 1
            continue
        e = math.log10(r) if math.isfinite(r) else math.inf
        counts[1 + sum(1 for edge in BIN_EDGES if e >= edge)] += 1
    return list(zip(labels, counts))


def svg_histogram(bins: Sequence[tuple[str, int]], width: int = 640, height: int = 220, name: str = "histogram") -> str:
    """Bars per bin; bars at or over tolerance (ratio >= 1) in red."""
    top = max((c for _, c in bins), default=0) or 1
    bar_w = width / len(bins)
    plot_h = height - 50
    parts = [_open(name, width, height)]
    for i, (label, count) in enumerate(bins):
        h = plot_h * count / top
        x, y = i * bar_w + 4, 20 + plot_h - h
        over = label.startswith(">=") or label.startswith("1e0..")
        parts.append(
            f'<rect class="bar" x="{x:.1f}" y="{y:.1f}" width="{bar_w - 8:.1f}" height="{h:.1f}" '
            f'fill="{RED if over else BLUE}"/>'
        )
        cx = x + (bar_w - 8) / 2
        parts.append(f'<text x="{cx:.1f}" y="{y - 4:.1f}" text-anchor="middle">{count}</text>')
        parts.append(
            f'<text x="{cx:.1f}" y="{height - 14}" font-size="10" text-anchor="middle">{html.escape(label)}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


def line_chart(
    series: dict[str, list[tuple[int, float | None]]],
    x_labels: Sequence[str],
    *,
    name: str,
    log: bool = True,
    threshold: float | None = 1.0,
    width: int = 760,
    height: int = 260,
) -> str:
    """One polyline per series over x = 0..len(x_labels)-1; log10 y by default (0 drawn at the
    bottom, inf at the top), a dashed red line at `threshold` (tolerance: ratio 1)."""
    x0, y0, w, h = 56, 12, width - 250, height - 44
    values = [v for pts in series.values() for _, v in pts if v is not None and math.isfinite(v) and (v > 0 or not log)]
    if log:  # one decade under the smallest positive value is where 0 (exact) is drawn
        lo = math.floor(math.log10(min(values))) - 1 if values else -1
        lo = max(-12, min(lo, -1))
        hi = max(1, math.ceil(math.log10(max(values)))) if values else 1
    else:
        lo, hi = 0.0, (max(values) * 1.1 if values else 1.0) or 1.0

    def y_of(v: float | None) -> float | None:
        if v is None:
            return None
        if log:
            t = hi if not math.isfinite(v) else (lo if v <= 0 else min(hi, max(lo, math.log10(v))))
        else:
            t = min(hi, max(lo, v)) if math.isfinite(v) else hi
        return y0 + h * (hi - t) / ((hi - lo) or 1)

    def x_of(i: int) -> float:
        return x0 + (w * i / max(1, len(x_labels) - 1))

    parts = [_open(name, width, height)]
    ticks = range(int(lo), int(hi) + 1, max(1, (int(hi) - int(lo)) // 6 or 1)) if log else [lo, (lo + hi) / 2, hi]
    for t in ticks:
        y = y0 + h * (hi - t) / ((hi - lo) or 1)
        label = ("0" if t == lo else f"1e{t}") if log else f"{t:.3g}"
        parts.append(f'<text x="4" y="{y + 4:.0f}">{label}</text>')
        parts.append(f'<line x1="{x0}" x2="{x0 + w}" y1="{y:.0f}" y2="{y:.0f}" stroke="#eee"/>')
    if threshold is not None:
        yt = y_of(threshold)
        parts.append(f'<line x1="{x0}" x2="{x0 + w}" y1="{yt:.0f}" y2="{yt:.0f}" stroke="{RED}" stroke-dasharray="4"/>')
    for i, label in enumerate(x_labels):
        parts.append(f'<text x="{x_of(i) - 6:.0f}" y="{height - 10}" font-size="10">{html.escape(label)}</text>')
    for i, (label, pts) in enumerate(series.items()):
        colour = COLOURS[i % len(COLOURS)]
        xy = [(x_of(x), y_of(v)) for x, v in pts if y_of(v) is not None]
        if len(xy) > 1:
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y in xy)
            parts.append(f'<polyline class="series" points="{path}" fill="none" stroke="{colour}" stroke-width="2"/>')
        for x, y in xy:
            parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3" fill="{colour}"/>')
        parts.append(f'<text x="{x0 + w + 12}" y="{y0 + 14 * i + 10}" fill="{colour}">{html.escape(label)}</text>')
    parts.append("</svg>")
    return "".join(parts)


def hbars(items: Sequence[tuple[str, float]], *, name: str, unit: str = "s", width: int = 640) -> str:
    """Horizontal bars, longest first (the slowest cases)."""
    height = 24 + 18 * max(1, len(items))
    top = max((v for _, v in items), default=0) or 1
    parts = [_open(name, width, height)]
    for i, (label, value) in enumerate(items):
        y = 12 + 18 * i
        bw = (width - 260) * value / top
        parts.append(f'<text x="6" y="{y + 11}">{html.escape(label)}</text>')
        parts.append(f'<rect class="bar" x="180" y="{y}" width="{max(bw, 1):.1f}" height="13" fill="{BLUE}"/>')
        parts.append(f'<text x="{186 + bw:.1f}" y="{y + 11}">{value:.2f} {unit}</text>')
    parts.append("</svg>")
    return "".join(parts)


def zoo_matrix(zoo: Sequence[dict], width: int = 760) -> str:
    """The detection matrix: a row per injected bug, green when caught (with the comparator and
    its ratio), red when not."""
    height = 30 + 20 * max(1, len(zoo))
    parts = [_open("zoo", width, height)]
    parts.append(
        '<text x="6" y="16" font-weight="bold">bug</text><text x="300" y="16" font-weight="bold">caught by</text>'
    )
    parts.append(
        '<text x="580" y="16" font-weight="bold">ratio</text><text x="670" y="16" font-weight="bold">examples</text>'
    )
    for i, bug in enumerate(zoo):
        y = 24 + 20 * i
        colour = GREEN if bug["caught"] else RED
        parts.append(
            f'<rect class="cell" x="2" y="{y}" width="{width - 4}" height="18" fill="{colour}" fill-opacity="0.18"/>'
        )
        by = f"{bug['comparator']} @ {bug.get('step', '')}/{bug.get('phase', '')}" if bug["caught"] else "NOT CAUGHT"
        r = bug["ratio"]
        parts.append(f'<text x="6" y="{y + 13}">{html.escape(bug["bug"])}</text>')
        parts.append(f'<text x="300" y="{y + 13}" fill="{colour}">{html.escape(by)}</text>')
        parts.append(
            f'<text x="580" y="{y + 13}">{r if isinstance(r, str) else ("" if r is None else f"{r:.3g}")}</text>'
        )
        parts.append(f'<text x="670" y="{y + 13}">{bug["examples"]}</text>')
    parts.append("</svg>")
    return "".join(parts)
