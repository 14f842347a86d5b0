"""Recorded runs as a user makes them: a script run on one process and under real torchrun, and
`fsdp-verify compare` on two runs (tests/test_recorder.py, the integrations' tests).

`single` and `sharded` launch the command a user types, one run each; `single_many` and
`sharded_many` run several runs of one script in one launch (tests/fixtures/run_each.py: one
interpreter per rank importing torch and the toolkit once, one torchrun), for the runs a test
needs besides the pair it shows as a user makes it (`single_many` also another script's runs as
the one rank of a 1-rank torchrun).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from fsdp_verify import launch
from fsdp_verify.commands.cli import main

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
# tests/fixtures/teardown_guard: a script that destroys its process group with a DDP module alive
# fails at once (the precondition of torch 2.13's rare teardown deadlock, see its docstring).
GUARD = ROOT / "tests" / "fixtures" / "teardown_guard"
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{GUARD}{os.pathsep}{ROOT}"}
# A launch takes 4-30 s here (alone to loaded); one still running after this is hung, and is
# ended with each process's Python stack (fsdp_verify.launch).
TIMEOUT_S = 120
RUN_EACH = ROOT / "tests" / "fixtures" / "run_each.py"
TORCHRUN = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node"]


# gloo's teardown at a process's exit, after the script's last line: torch 2.13 aborted a rank there
# now and then in loaded full runs (SIGABRT, a joinable thread destroyed; the same abort as
# tests/upstream/test_fsdp1_hybrid_shard_group_of_one.py and verify/sharded/torchrun.py note),
# once in CI after every step had trained and been recorded. Not what these runs test: a launch
# that ends in that abort, and only that one, is run again once, into a fresh directory.
TEARDOWN_ABORT = "terminate called without an active exception"


def run(
    cmd: list[str], env: dict | None = None, out: Path | Sequence[Path] = (), timeout: float = TIMEOUT_S
) -> subprocess.CompletedProcess:
    """`cmd` to its end, which must be a success; `out`: the run directories it writes, emptied
    before the one retry a teardown abort gets."""
    outs = [out] if isinstance(out, Path) else list(out)

    def once() -> subprocess.CompletedProcess:
        return launch.run(cmd, timeout=timeout, env={**ENV, **(env or {})}, cwd=ROOT)

    r = once()
    if r.returncode != 0 and outs and TEARDOWN_ABORT in r.stderr:
        for o in outs:
            shutil.rmtree(o, ignore_errors=True)
        r = once()
    assert r.returncode == 0, f"{_which_run(r.stderr)}{cmd}\n{r.stdout}\n{r.stderr[-3000:]}"
    return r


def _which_run(stderr: str) -> str:
    """For a launch of run_each.py: the run that failed (its own line), or else the last one begun."""
    said = [line for line in stderr.splitlines() if line.startswith("run_each: run ")]
    failed = [line for line in said if " failed (rank " in line]
    if failed:
        return "\n".join(failed) + "\n"
    return f"{said[-1]} (the last run begun; it ended without a Python error)\n" if said else ""


def single(script: Path, out: Path, *extra: str, env: dict | None = None) -> None:
    run([sys.executable, str(script), "--out", str(out), *extra], env)


def sharded(script: Path, out: Path, *extra: str, ranks: int = 2) -> None:
    run([*TORCHRUN, str(ranks), str(script), "--out", str(out), *extra], out=out)


# A run of a batch: its directory, its arguments after `--out DIR`, and the variables it runs with
# besides ENV (set for it alone).
BatchRun = tuple[Path, Sequence[str]] | tuple[Path, Sequence[str], dict]


# What `torchrun --nproc-per-node 1` sets for its one rank: a script that initialises its process
# group from the environment runs as that rank in a plain process (the store's port chosen by the OS).
ONE_RANK = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
ONE_RANK |= {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}


def single_many(script: Path, runs: Sequence[BatchRun], then: tuple[Path, Sequence[BatchRun]] | None = None) -> None:
    """Each run as `python SCRIPT --out DIR ARGS` would make it, in turn, all in one process;
    `then`: another script's runs after them, each as the one rank of `torchrun --nproc-per-node 1`
    (one process and one torch start fewer than a launch of their own)."""
    extra = []
    if then is not None:
        other, one_rank = then
        extra = [
            {"script": str(other), **_entry((r[0], r[1], {**ONE_RANK, **(r[2] if len(r) > 2 else {})}))}
            for r in one_rank
        ]
    _many([sys.executable], script, runs, extra)


def sharded_many(script: Path, runs: Sequence[BatchRun], ranks: int = 2) -> None:
    """Each run as `torchrun --standalone --nproc-per-node RANKS SCRIPT --out DIR ARGS` would make
    it, in turn, all in one torchrun launch (each rank one process for all the runs)."""
    _many([*TORCHRUN, str(ranks)], script, runs)


def _entry(r: BatchRun) -> dict:
    return {"out": str(r[0]), "args": [str(a) for a in r[1]], "env": dict(r[2]) if len(r) > 2 else {}}


def _many(launcher: list[str], script: Path, runs: Sequence[BatchRun], extra: Sequence[dict] = ()) -> None:
    config = {"script": str(script), "runs": [*map(_entry, runs), *extra]}
    with tempfile.TemporaryDirectory(prefix="run_each-") as tmp:
        path = Path(tmp) / "runs.json"
        path.write_text(json.dumps(config, indent=1))
        outs = [Path(r["out"]) for r in config["runs"]]
        run([*launcher, str(RUN_EACH), str(path)], out=outs, timeout=TIMEOUT_S * len(outs))


def compare(*args, capsys) -> tuple[int, str]:
    code = main(["compare", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out + out.err
