"""`--json PATH` for every command, with `-` for standard output (the Unix convention): the JSON
alone is written there, and what the command prints for a person goes to standard error instead,
so `fsdp-verify check --json - | jq .ok` reads one document."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

STDOUT = Path("-")
HELP = "('-': standard output, the text for a person then on standard error)"

_stdout = None  # the standard output the JSON goes to, while `to_stderr` holds the text


def wanted(args) -> bool:
    """Whether this command's JSON goes to standard output."""
    return getattr(args, "json", None) == STDOUT


@contextlib.contextmanager
def to_stderr(args) -> Iterator[None]:
    """While the command runs: where its JSON goes to standard output, its prints go to standard
    error (the JSON writer keeps the real standard output)."""
    global _stdout
    if not wanted(args):
        yield
        return
    _stdout = sys.stdout
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        _stdout = None


def write_json(path: Path, data: Any, default=str) -> None:
    """`data` as indented JSON at `path` (its folder made), or on standard output for `-`."""
    text = json.dumps(data, indent=2, default=default) + "\n"
    if path == STDOUT:
        out = _stdout or sys.stdout
        out.write(text)
        out.flush()
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
