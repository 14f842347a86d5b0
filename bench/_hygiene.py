"""What every benchmark does around its work: a private temporary directory that must be empty
at the end (RankPool's rendezvous dirs, FileStores: this process's and its children's, as TMPDIR
is inherited), checked and removed; other engineers' runs on the machine don't disturb the check."""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator


@contextlib.contextmanager
def private_tmp(name: str) -> Iterator[str]:
    root = tempfile.mkdtemp(prefix=f"fsdp-verify-{name}-")
    before_env, before_dir = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"], tempfile.tempdir = root, root
    try:
        yield root
    finally:
        tempfile.tempdir = before_dir
        if before_env is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = before_env
        # torch's own compile cache (torchinductor_USER) is made lazily under the temp dir and is
        # meant to persist between runs: not something this run forgot to remove.
        left = sorted(n for n in os.listdir(root) if not n.startswith("torchinductor_"))
        shutil.rmtree(root, ignore_errors=True)
        if left:
            print(f"LEFT BEHIND in the temporary directory: {left}", file=sys.stderr)
            raise SystemExit(3)
        print(f"temporary files: none left behind ({root} removed)")
