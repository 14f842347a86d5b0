"""Freed memory kept for reuse, in the processes the toolkit owns.

glibc's malloc serves each large block (a record's copy, a gather buffer, an activation) with
fresh pages from the kernel and hands them back when it is freed, so every copy of a record pays
a page fault per 4 KB: on this project's 2-core machine a 74 MB copy took 46 ms into fresh pages
and 8 ms into reused ones. A check copies every step's parameters, gradients and optimizer state,
case after case; with freed blocks kept in the heap (no mmap per block, no trimming), every case
after the first copies into pages already there. The price: a process keeps its peak heap until
it exits (a pool's ranks and the command's own process, which both live for their cases).
Measured (tests/test_arena.py): 32 freed 1 MB blocks, filled again, fault no page. Untuned,
glibc's threshold moves with what came before: the same blocks faulted all 8,192 pages every
round in one process and 256 in another. A single block past 32 MiB still comes from mmap on glibc 2.36.

Called by pool ranks (verify/sharded/worker.py), by ranks under torchrun (torchrun.py) and by the
command line (verify/commands/cli.py); not in a user's own process (the pytest plugin, the
recorder). No-op where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_KEEP = 1 << 30  # 1 GiB asked: blocks up to this size from the heap, this much free kept in it
_KEEP_OLD_GLIBC = 32 << 20  # glibc before 2.35 caps the mmap threshold at 32 MiB


def keep_freed_memory() -> bool:
    """Whether malloc now keeps freed memory for reuse."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    kept = mallopt(_M_MMAP_THRESHOLD, _KEEP) or mallopt(_M_MMAP_THRESHOLD, _KEEP_OLD_GLIBC)
    return bool(kept and mallopt(_M_TRIM_THRESHOLD, _KEEP))
