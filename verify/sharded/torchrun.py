"""In place under `torchrun`: PyTorch's launcher started one process per rank (RANK, WORLD_SIZE and
LOCAL_RANK set), so there is no pool: every rank runs the sharded side in this very process on the
launcher's process group (NCCL with one GPU per rank when CUDA is present, gloo on CPU), and rank 0
also runs the reference and judges."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from fsdp_verify.case import Case
from fsdp_verify.runner import emulating_reference, judge
from fsdp_verify.sharded.loop import RankContext, run_sharded
from fsdp_verify.sharded.worker import MeshCache, device_for
from fsdp_verify.verdict import Verdict


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def check_in_place(case: Case, calibrate: bool = True) -> tuple[Verdict | None, bool]:
    """Every rank runs the sharded side in this very process (PyTorch's launcher started us);
    rank 0 also runs the reference and judges. Returns (the verdict on rank 0, None elsewhere;
    whether rank 0 found the runs equivalent) on every rank."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != case.world_size:
        raise ValueError(f"world_size: the case says {case.world_size}, torchrun started {world} ranks")
    device, backend = device_for(int(os.environ["LOCAL_RANK"]))
    if not dist.is_initialized():
        dist.init_process_group(backend)
    mesh = MeshCache(device.type).get(case.mesh)
    got = run_sharded(case, RankContext(rank, world, device, mesh))
    verdict = judge(case, emulating_reference(case), got, calibrate) if rank == 0 else None
    code = torch.tensor([0 if verdict is None or verdict.ok else 1], device=device)
    dist.broadcast(code, src=0)  # every rank exits with rank 0's verdict
    return verdict, code.item() == 0
