"""Repro files: a failing Case written where a person (or `git bisect run`) can replay it."""

from __future__ import annotations

import shlex
from pathlib import Path

from fsdp_verify.case import Case


def write_repro(case: Case, out_dir: str | Path) -> Path:
    """Write `case` as `<out_dir>/case-<hash>.json` and return the path."""
    return case.save(Path(out_dir) / f"case-{case.hash}.json")


def replay_command(path: str | Path) -> str:
    """The one command that replays a repro file."""
    return f"fsdp-verify repro {shlex.quote(str(path))}"
