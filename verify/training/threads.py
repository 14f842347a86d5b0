"""The thread count both sides compute with: a rank process runs one thread (the world's
processes share the machine's cores, verify/sharded/worker.py), and the reference, in whichever
process, runs as a rank does, since a multi-threaded CPU kernel may split a sum over threads and
so round differently."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def rank_like_threads() -> Iterator[None]:
    """Run the enclosed work with the thread count of a rank process (1)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
