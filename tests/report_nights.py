"""Report folders the report tests share, made once per test session by real commands: five
nightly folders (the sweep and the zoo; night 4 swaps FSDP2 for a zoo mutant), check pages (passing
and failing), a fuzz report, and two nights whose second fails many cases by a few causes (their
trend page too). Built under a file lock, so xdist workers build them once."""

from __future__ import annotations

import shutil
from pathlib import Path

from fsdp_verify.commands.cli import main
from tests.built_once import built_once

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

# Two nights of one draw: FSDP2, then an engine that fails 7 of its 8 cases by 3 causes
# (tests/engines/many_causes.py; seed 21 draws each cause at least twice and one passing case: the
# draws of seed 10 moved when units over several modules joined the draw of an engine built on fsdp2,
# those of seed 20 when the dimension packages (float8) joined the draw).
MANY_CAUSES = "tests/engines/many_causes.py:shard"
CAUSES_DRAW = ["--cases", "8", "--seed", "21", "--world-sizes", "2", "3", "--precisions", "fp32", "bf16"]
CAUSES_DRAW += ["--models", "mlp"]
CAUSES_NIGHTS = {"2026-12-01": "fsdp2", "2026-12-02": MANY_CAUSES}


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
    for night, engine in CAUSES_NIGHTS.items():
        out = root / "causes-nights" / night / "sweep"
        _run(["sweep", "--engine", engine, *CAUSES_DRAW, "--no-progress", "--out", str(out)], ok=(0, 1))
    _run(["report", "trend", str(root / "causes-nights"), "--out", str(root / "causes-trend.html")])
    return root


def shared(tmp_path_factory) -> Path:
    """The folders, built once per test run (tests/built_once.py)."""
    return built_once(tmp_path_factory, "report-nights", build)
