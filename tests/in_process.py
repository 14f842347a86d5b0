"""`fsdp-verify ARGS` run in this very process: `main(ARGS)` with the output captured at the file
descriptors (what the ranks relay to fd 2 included), the working directory and environment set
for the call, and the exit code main returns (or argparse's SystemExit).

Why: a command in a fresh process starts torch twice (the command, then its pool's zygote), about
4.5 s of CPU before any work, and the tests run dozens of commands whose subject is what the
command says and returns, not the console entry point. Here they share the test process's warm
pools. What a fresh process adds (the entry point's exit status, Ctrl-C) keeps tests of its own in
a subprocess (tests/test_cli.py, tests/test_interrupt.py), and FSDP_VERIFY_TESTS_IN_SHELL=1 runs
every documented command through the shell, as the nightly does.
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from fsdp_verify.commands.cli import main

IN_SHELL = os.environ.get("FSDP_VERIFY_TESTS_IN_SHELL") == "1"


def run_cli(
    args: Sequence[str], cwd: str | Path | None = None, env: dict | None = None, merge_stderr: bool = False
) -> subprocess.CompletedProcess:
    """`fsdp-verify *args` as `subprocess.run(..., capture_output=True, text=True)` would return it."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        with _environment(env), _cwd(cwd), _captured(out, out if merge_stderr else err):
            try:
                code = main(list(args))
            except SystemExit as e:  # argparse: a bad flag, --help, --version
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
        return subprocess.CompletedProcess(["fsdp-verify", *args], code, _read(out), "" if merge_stderr else _read(err))


@contextlib.contextmanager
def _captured(out, err) -> Iterator[None]:
    """fds 1 and 2 onto the files (the ranks' relayed output and C++ lines land there) and
    sys.stdout/sys.stderr writing through to them at once, so that their lines interleave as a
    terminal shows them."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    streams = sys.stdout, sys.stderr
    try:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        sys.stdout = _text(os.dup(out.fileno()))
        sys.stderr = _text(os.dup(err.fileno()))
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
            stream.close()
        sys.stdout, sys.stderr = streams
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)


def _text(fd: int) -> io.TextIOWrapper:
    return io.TextIOWrapper(io.FileIO(fd, "w"), encoding="utf-8", errors="replace", write_through=True)


def _read(f) -> str:
    f.seek(0)
    return f.read().decode("utf-8", errors="replace")


@contextlib.contextmanager
def _cwd(path: str | Path | None) -> Iterator[None]:
    before = os.getcwd()
    if path is not None:
        os.chdir(path)
    try:
        yield
    finally:
        os.chdir(before)


@contextlib.contextmanager
def _environment(env: dict | None) -> Iterator[None]:
    """os.environ as `env` for the call (None: unchanged), restored after."""
    if env is None:
        yield
        return
    before = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(before)
