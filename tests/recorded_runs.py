"""Recorded runs as a user makes them: a script run on one process and under real torchrun, and
`fsdp-verify compare` on two runs (tests/test_recorder.py, the integrations' tests)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
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


# gloo's teardown at a process's exit, after the script's last line: torch 2.13 aborted a rank there
# now and then in loaded full runs (SIGABRT, a joinable thread destroyed; the same abort as
# tests/upstream/test_fsdp1_hybrid_shard_group_of_one.py and verify/sharded/torchrun.py note),
# once in CI after every step had trained and been recorded. Not what these runs test: a launch
# that ends in that abort, and only that one, is run again once, into a fresh directory.
TEARDOWN_ABORT = "terminate called without an active exception"


def run(cmd: list[str], env: dict | None = None, out: Path | None = None) -> subprocess.CompletedProcess:
    def once() -> subprocess.CompletedProcess:
        return launch.run(cmd, timeout=TIMEOUT_S, env={**ENV, **(env or {})}, cwd=ROOT)

    r = once()
    if r.returncode != 0 and out is not None and TEARDOWN_ABORT in r.stderr:
        shutil.rmtree(out, ignore_errors=True)
        r = once()
    assert r.returncode == 0, f"{cmd}\n{r.stdout}\n{r.stderr[-3000:]}"
    return r


def single(script: Path, out: Path, *extra: str, env: dict | None = None) -> None:
    run([sys.executable, str(script), "--out", str(out), *extra], env)


def sharded(script: Path, out: Path, *extra: str, ranks: int = 2) -> None:
    torchrun = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(ranks)]
    run([*torchrun, str(script), "--out", str(out), *extra], out=out)


def compare(*args, capsys) -> tuple[int, str]:
    code = main(["compare", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out + out.err
