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
from typing import Any

import torch.multiprocessing as mp

PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor"]


def on_threads(world: int, fn: Callable[[int], Any]) -> dict[int, Any]:
    """`fn(rank)` on `world` threads, each a rank of PyTorch's threaded process group (made and
    destroyed around it): every rank's result. For what is not a collective under test (a mesh's
    layout), or to compare against the path bench/pool_vs_cold.py takes."""
    import threading

    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.multi_threaded_pg import _install_threaded_pg, _uninstall_threaded_pg

    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    _install_threaded_pg()
    store, got, errors = dist.HashStore(), {}, []

    def rank_main(rank: int) -> None:
        try:
            dist.init_process_group("threaded", rank=rank, world_size=world, store=store)
            got[rank] = fn(rank)
            dist.destroy_process_group()
        except BaseException as e:  # noqa: BLE001 - raised below, after every thread ends
            errors.append(e)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        _uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    if errors:
        raise errors[0]
    return got


def spawn(fn: Callable, args: tuple = (), nprocs: int = 1, join: bool = True):
    """`mp.spawn(fn, args, nprocs, join)`, the processes forked from the preloaded server."""
    mp.set_forkserver_preload(PRELOAD)
    return mp.start_processes(fn, args=args, nprocs=nprocs, join=join, start_method="forkserver")
