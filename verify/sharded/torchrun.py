"""In place under `torchrun`: PyTorch's launcher started one process per rank (RANK, WORLD_SIZE and
LOCAL_RANK set), so there is no pool: every rank runs the sharded side in this very process on the
launcher's process group (NCCL with one GPU per rank when CUDA is present, gloo on CPU). The
reference's emulated ranks are split over the ranks on rank 0's host (verify/sharded/
shared_reference.py; across hosts, a subgroup of them: the others only wait), and rank 0 judges."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Iterator
from typing import NoReturn

import torch
import torch.distributed as dist

from fsdp_verify.case import Case
from fsdp_verify.runner import emulating_reference, judge
from fsdp_verify.sharded.allocator import keep_freed_memory
from fsdp_verify.sharded.arena import release_arenas
from fsdp_verify.sharded.loop import RankContext, run_sharded
from fsdp_verify.sharded.pool import memory_dir
from fsdp_verify.sharded.shared_reference import SharedReference, SplitUnsafe
from fsdp_verify.sharded.worker import MeshCache, device_for
from fsdp_verify.trace import Trace
from fsdp_verify.training.threads import rank_like_threads
from fsdp_verify.verdict import Verdict


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def check_in_place(case: Case, calibrate: bool = True) -> tuple[Verdict | None, bool]:
    """Every rank runs the sharded side in this very process (PyTorch's launcher started us) and
    its share of the reference; rank 0 judges. Returns (the verdict on rank 0, None elsewhere;
    whether rank 0 found the runs equivalent) on every rank."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != case.world_size:
        raise ValueError(f"world_size: the case says {case.world_size}, torchrun started {world} ranks")
    keep_freed_memory()  # this process is the command's (verify/sharded/allocator.py)
    device, backend = device_for(int(os.environ["LOCAL_RANK"]))
    if not dist.is_initialized():
        dist.init_process_group(backend)
    mesh = MeshCache(device.type).of(case)
    with shared_spill_dir() as spill_dir:
        got = run_sharded(case, RankContext(rank, world, device, mesh, spill_dir=spill_dir))
        ref, split = reference_in_place(case, spill_dir)
    verdict = judge(case, ref, got, calibrate) if rank == 0 else None
    if verdict is not None:
        verdict.reference_ranks = split
    code = torch.tensor([0 if verdict is None or verdict.ok else 1], device=device)
    dist.broadcast(code, src=0)  # every rank exits with rank 0's verdict
    return verdict, code.item() == 0


def leave_in_place(code: int) -> NoReturn:
    """End this rank's process with `code`, its output flushed, without running destructors:
    gloo's teardown at interpreter exit (the default group's, the subgroups and DeviceMesh's)
    aborted a rank that had already printed EQUIVALENT ("terminate called without an active
    exception", SIGABRT: a joinable thread destroyed), in a loaded CI run of the two-hosts test
    (tests/test_shared_reference.py), as in tests/upstream/test_fsdp1_hybrid_shard_group_of_one.py.
    Every file is written and every collective done by then (rank 0's verdict broadcast)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def reference_in_place(case: Case, spill_dir: str | None) -> tuple[Trace | None, list[int]]:
    """The reference, called on every rank: its emulated ranks split over the ranks that share
    rank 0's host (verify/sharded/shared_reference.py: they exchange their passes through memory,
    which only processes on one host share), else run whole by rank 0. Returns (rank 0: the trace,
    the others None; the global ranks that ran its passes)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    with rank_like_threads():
        if world > 1 and case.step is None:
            with host_of_rank_0(spill_dir) as (group, ranks, directory):
                if len(ranks) > 1 and rank in ranks:
                    share = SharedReference(ranks.index(rank), len(ranks), directory, group=group)
                    try:
                        ref = emulating_reference(case, share=share)
                        return (ref if rank == 0 else None), ranks
                    except SplitUnsafe:  # moved buffers or a full memory directory: every rank of the split raised it
                        pass
        return (emulating_reference(case) if rank == 0 else None), [0]


def node_of_this_rank() -> tuple[str, str]:
    """What says two ranks share a host: the machine's name and torchrun's node (GROUP_RANK), so
    two launchers on one machine (`--nnodes 2`, as the tests run them) count as two hosts."""
    return socket.gethostname(), os.environ.get("GROUP_RANK", "0")


@contextlib.contextmanager
def host_of_rank_0(spill_dir: str | None) -> Iterator[tuple[dist.ProcessGroup | None, list[int], str | None]]:
    """(the process group, the global ranks, a memory directory) of the ranks on rank 0's host; a
    collective of every rank. On one host that is every rank and the run's own `spill_dir`; across
    hosts a subgroup (`new_group` is called by every rank, as it must be) with a directory of its own,
    removed afterwards."""
    if spill_dir is not None:
        yield None, list(range(dist.get_world_size())), spill_dir
        return
    nodes: list = [None] * dist.get_world_size()
    dist.all_gather_object(nodes, node_of_this_rank())
    ranks = [r for r, node in enumerate(nodes) if node == nodes[0]]
    group = dist.new_group(ranks)
    if dist.get_rank() not in ranks:
        yield group, ranks, None
        return
    made = [tempfile.mkdtemp(prefix="fsdp-verify-ref-", dir=memory_dir()) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(made, src=0, group=group)
    try:
        yield group, ranks, made[0]
    finally:
        release_arenas()
        dist.barrier(group=group)
        if dist.get_rank() == 0:
            shutil.rmtree(made[0], ignore_errors=True)


@contextlib.contextmanager
def shared_spill_dir() -> Iterator[str | None]:
    """A directory rank 0 makes in memory (/dev/shm, else the temp directory) for the ranks'
    pieces of the records (verify/sharded/collect.py) when every rank runs on this host
    (torchrun's LOCAL_WORLD_SIZE equals WORLD_SIZE); None across hosts. Removed afterwards."""
    one_host = os.environ.get("LOCAL_WORLD_SIZE") == os.environ["WORLD_SIZE"]
    if not one_host:
        yield None
        return
    made = [tempfile.mkdtemp(prefix="fsdp-verify-run-", dir=memory_dir()) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(made, src=0)
    try:
        yield made[0]
    finally:
        release_arenas()  # rank 0 read them in the case's last gather
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(made[0], ignore_errors=True)
