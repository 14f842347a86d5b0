"""Folders a test module builds once per test run, whichever pytest-xdist workers run its tests.

A module-scoped fixture is built by every worker that runs one of the module's tests, and `-n auto`
splits a module's tests between workers as it pleases: the recorded runs of tests/test_recorder.py
(35-55 s of two cores) were built twice in some runs of the suite and once in others. pytest-xdist's
`--dist loadgroup` would keep a module on one worker, but with pytest 9.2 it silently stops grouping
(pytest-dev/pytest-xdist#1386: it still renames the node IDs, which pytest 9.2 no longer reads).
So the first worker that asks builds the folder, under a file lock; a worker asking meanwhile
waits for it, and any later one finds it built.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock


def built_once(tmp_path_factory, name: str, build: Callable[[Path], object], into: Path | None = None) -> Path:
    """The folder `build(folder)` filled, built by the first worker of this run that asks. Under
    xdist the workers' temporary folders share this run's parent; without it the parent is every
    run's, so the run's own folder is used (a build of an earlier run must never stand in for this
    one's). `into`: an existing folder that `build` adds to (a fixture adding runs to another's)."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent
    folder = into if into is not None else base / name
    with FileLock(str(base / f"{name}.lock")):
        done = base / f"{name}.done"
        if not done.exists():
            if into is None:
                shutil.rmtree(folder, ignore_errors=True)
                folder.mkdir(parents=True)
            build(folder)
            done.write_text("ok\n")
    return folder
