"""In place under `torchrun`: PyTorch's launcher started one process per rank (RANK, WORLD_SIZE and
LOCAL_RANK set), so there is no pool: every rank runs the sharded side in this very process on the
launcher's process group (NCCL with one GPU per rank when CUDA is present, gloo on CPU). The
reference's emulated ranks are split over the ranks where they share a host
(verify/sharded/shared_reference.py; rank 0 runs it whole across hosts), and rank 0 judges."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator

import torch
import torch.distributed as dist

from fsdp_verify.case import Case
from fsdp_verify.runner import emulating_reference, judge, rank_like_threads
from fsdp_verify.sharded.allocator import keep_freed_memory
from fsdp_verify.sharded.arena import release_arenas
from fsdp_verify.sharded.loop import RankContext, run_sharded
from fsdp_verify.sharded.pool import memory_dir
from fsdp_verify.sharded.shared_reference import SharedReference, SplitUnsafe
from fsdp_verify.sharded.worker import MeshCache, device_for
from fsdp_verify.trace import Trace
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
    mesh = MeshCache(device.type).get(case.mesh)
    with shared_spill_dir() as spill_dir:
        got = run_sharded(case, RankContext(rank, world, device, mesh, spill_dir=spill_dir))
        ref = reference_in_place(case, spill_dir)
    verdict = judge(case, ref, got, calibrate) if rank == 0 else None
    code = torch.tensor([0 if verdict is None or verdict.ok else 1], device=device)
    dist.broadcast(code, src=0)  # every rank exits with rank 0's verdict
    return verdict, code.item() == 0


def reference_in_place(case: Case, spill_dir: str | None) -> Trace | None:
    """The reference, called on every rank: its emulated ranks split over the ranks where they
    share a host (`spill_dir`, verify/sharded/shared_reference.py), else run whole by rank 0.
    Rank 0 gets the trace, the others None."""
    rank, world = dist.get_rank(), dist.get_world_size()
    with rank_like_threads():
        if spill_dir is not None and world > 1 and case.step is None:
            try:
                ref = emulating_reference(case, share=SharedReference(rank, world, spill_dir))
                return ref if rank == 0 else None
            except SplitUnsafe:  # moved buffers or a full memory directory: every rank raised it together
                pass
        return emulating_reference(case) if rank == 0 else None


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
