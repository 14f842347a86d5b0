"""A test's rank processes: torch.multiprocessing's, forked from one server per test process that
imported torch once (the "forkserver" start method with torch's distributed packages preloaded),
not a fresh interpreter per rank importing torch again (1.5 to 2 s of CPU each on the CI machine,
the better part of a small multi-rank test). The rank's code runs as under `mp.spawn`; only how
its process starts differs, and how it ends: a forked process leaves with `os._exit`, after its
function returns, without the interpreter's finalisation (the pool's workers leave the same way,
verify/sharded/worker.py). tests/upstream/ keeps `mp.spawn`: those are PyTorch's repros, as a
PyTorch developer runs them."""

from __future__ import annotations

from collections.abc import Callable

import torch.multiprocessing as mp

PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor"]


def spawn(fn: Callable, args: tuple = (), nprocs: int = 1, join: bool = True):
    """`mp.spawn(fn, args, nprocs, join)`, the processes forked from the preloaded server."""
    mp.set_forkserver_preload(PRELOAD)
    return mp.start_processes(fn, args=args, nprocs=nprocs, join=join, start_method="forkserver")
