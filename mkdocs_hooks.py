"""MkDocs hooks. The command reference (docs/cli.md) is generated at build time from the argparse
parsers `fsdp-verify` itself runs (fsdp_verify.commands.cli.build_parser), so the reference cannot
drift from the commands: no help text is copied by hand.

docs/cli.md holds the marker line below; the hook replaces it with one section per command (and
per `report` subcommand): its one-line help, then `--help` as argparse prints it.

The Python API page (mkdocstrings) reads the package as installed: `fsdp_verify` is the folder
verify/ with reference/ and properties/ mapped under it (pyproject's package-dir), which a finder
of source folders does not follow past the top level. So the build lays out that tree under
build/api-tree (symbolic links, nothing copied) and mkdocs.yml points mkdocstrings there.
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

MARKER = "<!-- cli-reference -->"
WIDTH = "100"
API_TREE = Path("build") / "api-tree"  # relative to mkdocs.yml's folder, as mkdocs.yml names it
MAPPED = {
    "reference": "reference",
    "properties": "properties",
}  # fsdp_verify.<key> is the folder <value>  # argparse wraps at $COLUMNS; fixed so the page does not depend on the terminal


def _subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, str, argparse.ArgumentParser]]:
    """(name, one-line help, parser) of each subcommand, in the order `--help` lists them."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            return [(name, helps.get(name, ""), sub) for name, sub in action.choices.items()]
    return []


def _help(parser: argparse.ArgumentParser) -> str:
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH
    try:
        return parser.format_help().rstrip()
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old


def _section(title: str, summary: str, parser: argparse.ArgumentParser, level: int) -> list[str]:
    out = [f"{'#' * level} `{title}`", ""]
    if summary:
        out += [summary[0].upper() + summary[1:] + ".", ""]
    out += ["```text", _help(parser), "```", ""]
    for name, help_text, sub in _subcommands(parser):
        if title != "fsdp-verify":
            out += _section(f"{title} {name}", help_text, sub, level + 1)
    return out


def cli_reference() -> str:
    """The Markdown of every command's reference, from the parsers themselves."""
    from fsdp_verify.commands.cli import build_parser

    parser = build_parser()
    out = _section("fsdp-verify", "", parser, 2)
    for name, help_text, sub in _subcommands(parser):
        out += _section(f"fsdp-verify {name}", help_text, sub, 2)
    return "\n".join(out)


def on_page_markdown(markdown: str, page, config, files) -> str:
    """MkDocs event: fill the marker of docs/cli.md with the generated reference."""
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, cli_reference())


def api_tree(root: Path) -> Path:
    """build/api-tree/fsdp_verify: verify/'s entries with reference/ and properties/ beside them."""
    package = root / API_TREE / "fsdp_verify"
    if package.parent.exists():
        shutil.rmtree(package.parent)
    package.mkdir(parents=True)
    for entry in (root / "verify").iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry.resolve())
    for name, folder in MAPPED.items():
        (package / name).symlink_to((root / folder).resolve())
    return package


def on_startup(command, dirty):
    """MkDocs event, before any plugin reads its configuration (mkdocstrings keeps only search
    paths that exist then): lay out the tree mkdocstrings reads."""
    api_tree(Path(__file__).resolve().parent)
