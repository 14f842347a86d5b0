"""Recorded runs as a user makes them: a script run on one process and under real torchrun, and
`fsdp-verify compare` on two runs (tests/test_recorder.py, the integrations' tests)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from fsdp_verify.commands.cli import main

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def run(cmd: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**ENV, **(env or {})}, cwd=ROOT)
    assert r.returncode == 0, f"{cmd}\n{r.stdout}\n{r.stderr[-3000:]}"
    return r


def single(script: Path, out: Path, *extra: str, env: dict | None = None) -> None:
    run([sys.executable, str(script), "--out", str(out), *extra], env)


def sharded(script: Path, out: Path, *extra: str, ranks: int = 2) -> None:
    torchrun = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(ranks)]
    run([*torchrun, str(script), "--out", str(out), *extra])


def compare(*args, capsys) -> tuple[int, str]:
    code = main(["compare", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out + out.err
