"""Report folders the report tests share, made once per test session by real commands: five
nightly folders (the sweep and the zoo; night 4 swaps FSDP2 for a zoo mutant), check pages (passing
and failing) and a fuzz report. Built under a file lock, so xdist workers build them once."""

from __future__ import annotations

import shutil
from pathlib import Path

from filelock import FileLock

from fsdp_verify.commands.cli import main

MUTANT = "fsdp_verify.zoo.mutants:grads_divided_twice"
CHEAP = ["--world-sizes", "2", "--models", "mlp", "--pin", "steps=1", "--no-progress"]
# night -> (seed, engine); nights 2 and 3 are the same run twice, night 4 the mutant.
NIGHTS = {
    "2026-11-01": (6, "fsdp2"),
    "2026-11-02": (7, "fsdp2"),
    "2026-11-03": (7, "fsdp2"),
    "2026-11-04": (7, MUTANT),
    "2026-11-05": (7, "fsdp2"),
}


def _run(args: list[str], ok: tuple[int, ...] = (0,)) -> None:
    code = main(args)
    assert code in ok, f"{args}: exit {code}"


def build(root: Path) -> Path:
    zoo = root / "zoo"
    _run(
        ["selftest", "--bugs", "grads_divided_twice", "clip_with_local_norm", "--world-sizes", "2"]
        + ["--max-examples", "3", "--out", str(zoo)]
    )
    for night, (seed, engine) in NIGHTS.items():
        d = root / "nights" / night
        joined = ["--zoo", str(zoo / "report.json")] if night == "2026-11-05" else []  # the zoo beside the ratios
        _run(
            ["sweep", "--cases", "4", "--seed", str(seed), "--engine", engine, *CHEAP, "--out", str(d / "sweep")]
            + joined,
            ok=(0, 1),
        )
        shutil.copytree(zoo, d / "zoo")
    _run(["check", "--model", "mlp", "--steps", "2", "--out", str(root / "check-ok")])
    _run(["check", "--model", "mlp", "--steps", "2", "--engine", MUTANT, "--out", str(root / "check-bad")], ok=(1,))
    _run(
        ["fuzz", "--max-examples", "3", "--world-sizes", "2", "--models", "mlp", "--profile", "ci", "--pin", "steps=1"]
        + ["--no-progress", "--out", str(root / "fuzz")]
    )
    _run(["report", "trend", str(root / "nights"), "--last", "5", "--out", str(root / "trend.html")])
    return root


def shared(tmp_path_factory) -> Path:
    """The folders, built by the first worker that asks."""
    base = tmp_path_factory.getbasetemp().parent
    root = base / "report-nights"
    with FileLock(str(base / "report-nights.lock")):
        if not (root / "done").exists():
            shutil.rmtree(root, ignore_errors=True)
            build(root)
            (root / "done").write_text("ok\n")
    return root
