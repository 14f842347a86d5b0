"""`fsdp-verify report merge|diff|trend`: the nightly's reports read together. merge makes shards'
sweep reports one, diff says what changed between two nights (exit 1 when something got worse),
trend draws the last K nights on one page. Bad input (a folder without a report, a report of
another schema_version, shards of different sweeps) exits 2 naming the file and field."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fsdp_verify.commands.json_out import HELP as JSON_HELP
from fsdp_verify.commands.json_out import write_json
from fsdp_verify.commands.options import EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_INFRA, EXIT_OK


def _factor(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 1:
        raise argparse.ArgumentTypeError(f"expected a number above 1, got {text!r}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, parser_class=type(p))
    m = sub.add_parser("merge", help="shards' sweep reports -> one report (a missing shard is named; exit 3)")
    m.add_argument("dirs", nargs="+", type=Path, metavar="DIR", help="shard output folders (each with report.json)")
    m.add_argument("--out", type=Path, required=True, help="folder for the merged report.json and report.html")
    d = sub.add_parser("diff", help="what changed between two nights; exit 1 if something got worse")
    d.add_argument("old", type=Path, metavar="OLD", help="a night's folder, a report folder or a report.json")
    d.add_argument("new", type=Path, metavar="NEW")
    d.add_argument(
        "--factor", type=_factor, default=2.0, help="a ratio moving by more than this is reported (default 2)"
    )
    d.add_argument("--json", type=Path, metavar="PATH", help="write the diff as JSON here " + JSON_HELP)
    d.add_argument("--html", type=Path, metavar="PATH", help="write the diff as an HTML page here")
    t = sub.add_parser("trend", help="one HTML page over the last K nights")
    t.add_argument("nights", type=Path, metavar="NIGHTS_DIR", help="a folder of night folders (names sort by date)")
    t.add_argument("--last", type=int, default=14, metavar="K", help="how many nights (default 14)")
    t.add_argument("--out", type=Path, metavar="PATH", help="the page (default NIGHTS_DIR/trend.html)")


def run(args: argparse.Namespace) -> int:
    from fsdp_verify.reports.schema import ReportError

    try:
        return {"merge": _merge, "diff": _diff, "trend": _trend}[args.action](args)
    except ReportError as e:
        print(f"fsdp-verify: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT


def _merge(args) -> int:
    from fsdp_verify.commands.sweep import summary
    from fsdp_verify.reports.merge import merge
    from fsdp_verify.reports.report import write
    from fsdp_verify.reports.schema import load

    merged = merge([(str(d), load(d)) for d in args.dirs])
    _, html_path = write(merged, args.out)
    print(summary(merged))
    print(f"merged shards {', '.join(merged['shards'])} of seed {merged['seed']}. Report: {html_path}")
    if merged["missing_shards"]:
        print(f"fsdp-verify: missing shards: {', '.join(merged['missing_shards'])}", file=sys.stderr)
        return EXIT_INFRA
    return EXIT_OK if merged["ok"] else EXIT_DIVERGED


def _diff(args) -> int:
    from fsdp_verify.reports.diff import diff, html_section, text
    from fsdp_verify.reports.page import page

    result = diff(args.old, args.new, args.factor)
    print(text(result))
    if args.json:
        write_json(args.json, result)
    if args.html:
        args.html.parent.mkdir(parents=True, exist_ok=True)
        args.html.write_text(page("fsdp-verify report diff", "<h1>fsdp-verify report diff</h1>" + html_section(result)))
    return EXIT_DIVERGED if result["worse"] else EXIT_OK


def _trend(args) -> int:
    from fsdp_verify.reports.trend import render

    if args.last < 1:
        print(f"fsdp-verify: --last: expected a positive integer, got {args.last}", file=sys.stderr)
        return EXIT_BAD_INPUT
    out = args.out or args.nights / "trend.html"
    page = render(args.nights, args.last)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page)
    print(f"Trend page: {out}")
    return EXIT_OK
