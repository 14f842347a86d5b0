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
    # Pools put their directories in memory (verify/sharded/pool.py memory_dir): here, privately.
    from fsdp_verify.sharded.pool import memory_dir

    memory = tempfile.mkdtemp(prefix=f"fsdp-verify-{name}-", dir=memory_dir())
    saved = {k: os.environ.get(k) for k in ("TMPDIR", "FSDP_VERIFY_MEMORY_DIR")}
    before_dir = tempfile.tempdir
    os.environ["TMPDIR"], tempfile.tempdir, os.environ["FSDP_VERIFY_MEMORY_DIR"] = root, root, memory
    try:
        yield root
    finally:
        tempfile.tempdir = before_dir
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        # torch's own compile cache (torchinductor_USER) is made lazily under the temp dir and is
        # meant to persist between runs: not something this run forgot to remove.
        left = sorted(n for n in os.listdir(root) if not n.startswith("torchinductor_"))
        left += [os.path.join(memory, n) for n in sorted(os.listdir(memory))]
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(memory, ignore_errors=True)
        if left:
            print(f"LEFT BEHIND in the temporary directory: {left}", file=sys.stderr)
            raise SystemExit(3)
        print(f"temporary files: none left behind ({root} removed)")


@contextlib.contextmanager
def rendezvous_file(tmp: str) -> Iterator[str]:
    """A path in `tmp` for rank processes' `file://` rendezvous; gloo may leave the file behind,
    and it is ours to remove (the check above would count it)."""
    path = os.path.join(tmp, "init")
    try:
        yield path
    finally:
        if os.path.exists(path):
            os.remove(path)
