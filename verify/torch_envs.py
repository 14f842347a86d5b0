"""One cached virtual environment per torch release, made with the ordinary tools (venv and pip),
for `fsdp-verify gate`: the same cases run under each release, each in its own interpreter, since
one process can import only one torch.

An environment is `CACHE/torch-VERSION`: `python -m venv`, then `pip install torch==VERSION` and
this project beside it in one resolution (so pip keeps that torch). A user's own interpreter (a
conda env, a container's python) can stand in for one: `NAME=PATH`."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from fsdp_verify import launch

VERSION = re.compile(r"^\d+\.\d+(\.\d+)?([a-z0-9.+]*)?$")


class EnvironmentFailed(Exception):
    """An environment that could not be made or does not import fsdp-verify and torch."""


@dataclass
class TorchEnv:
    name: str  # what the gate calls it: the torch release asked for, or the user's NAME
    python: Path
    torch: str  # what `import torch` says inside it
    root: Path | None = None  # the cached environment's folder; None for a user's interpreter
    made_seconds: float | None = None  # None: found in the cache or given by the user

    def disk_bytes(self) -> int | None:
        """The cached environment's size on disk (None for a user's interpreter)."""
        if self.root is None:
            return None
        return sum(f.stat().st_size for f in self.root.rglob("*") if f.is_file() and not f.is_symlink())


def default_cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fsdp-verify" / "torch-envs"


def project_requirement() -> list[str]:
    """What pip installs beside torch: this checkout, editable, when fsdp-verify runs from one (so
    a cached environment always runs the checkout's current code, as in development and CI), else
    the same release from the package index."""
    dist = metadata.distribution("fsdp-verify")
    direct = json.loads(dist.read_text("direct_url.json") or "{}")
    url = direct.get("url", "")
    if url.startswith("file://") and direct.get("dir_info", {}).get("editable"):
        return ["-e", url[len("file://") :]]
    return [f"fsdp-verify=={dist.version}"]


def probe(python: Path) -> str:
    """The torch version inside `python`, or an EnvironmentFailed saying what is missing. Read from
    the installed packages' metadata, not by importing them: an import of torch costs 1.5 s of
    CPU per environment before the sweep there imports it again (an installed torch that cannot
    import still ends that sweep, which the gate reports as not finished)."""
    code = (
        "import importlib.metadata as m, importlib.util as u\n"
        "missing = [n for n in ('torch', 'fsdp_verify') if u.find_spec(n) is None]\n"
        "if missing: raise SystemExit('No module named ' + ', '.join(missing))\n"
        "print(m.version('torch'))"
    )
    done = launch.run([str(python), "-c", code], timeout=300)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise EnvironmentFailed(f"{python}: cannot import torch and fsdp_verify ({last})")
    return done.stdout.strip()


def ensure(version: str, cache: Path, project: Sequence[str], pip_args: Sequence[str] = (), log=print) -> TorchEnv:
    """The cached environment for torch `version`, made on first use. `pip_args` go to pip as
    they are (`--index-url https://download.pytorch.org/whl/cpu` for CPU builds on a CPU runner)."""
    if not VERSION.match(version):
        raise ValueError(f"--torch: expected a release such as 2.12.0, got {version!r}")
    root = cache / f"torch-{version}"
    python = root / "bin" / "python"
    if python.exists():
        try:
            return TorchEnv(version, python, probe(python), root)
        except EnvironmentFailed:  # torch there but not this project (or a half-made venv): pip completes it
            pass
    start = time.monotonic()
    log(f"gate: making {root} (torch=={version}; a CUDA build is several GB on first use)")
    root.parent.mkdir(parents=True, exist_ok=True)
    steps = [] if python.exists() else [[sys.executable, "-m", "venv", str(root)]]
    steps += [
        [str(python), "-m", "pip", "install", "-q", *pip_args, f"torch=={version}", *project],
    ]
    for cmd in steps:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            tail = "\n".join(done.stderr.strip().splitlines()[-5:])  # the venv stays: the next run completes it
            raise EnvironmentFailed(f"torch=={version}: `{' '.join(cmd[2:])}` failed:\n{tail}")
    return TorchEnv(version, python, probe(python), root, made_seconds=time.monotonic() - start)


def given(spec: str) -> TorchEnv:
    """`NAME=PATH`: a user's own interpreter as one of the gate's environments."""
    name, sep, path = spec.partition("=")
    if not sep or not name or not path:
        raise ValueError(f"--python: expected NAME=PATH (e.g. nightly=/opt/envs/nightly/bin/python), got {spec!r}")
    python = Path(path)
    if not python.exists():
        raise ValueError(f"--python: {path} does not exist")
    return TorchEnv(name, python, probe(python))
