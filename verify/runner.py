"""Run one Case on both sides and judge it: the reference in this process while the pool's ranks
run the sharded side, then the comparators, then the verdict."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from reference import train_reference
from verify.case import Case
from verify.checks import run_checks
from verify.comparators import compare_traces
from verify.localize import hint
from verify.pool import RankPool, get_pool
from verify.trace import Trace
from verify.verdict import Verdict


def calibration_runs(case: Case) -> list[Trace]:
    """Numerically equivalent reference runs: ranks reduced in rank and in reverse order, and (without
    dropout, whose masks depend on the per-rank split) the global batch in one piece."""
    runs = [train_reference(case, order="rank"), train_reference(case, order="reverse")]
    if case.model.dropout == 0:
        runs.append(train_reference(case, emulate=False))
    return runs


def judge(case: Case, ref: Trace, got: Trace, calibrate: bool = True) -> Verdict:
    calibrated: list[bool] = []

    def calibration() -> list[Trace]:
        calibrated.append(True)
        return calibration_runs(case)

    findings = compare_traces(ref, got, calibration if calibrate else None) + run_checks(case, ref, got)
    verdict = Verdict(case, findings, calibrated=bool(calibrated))
    verdict.hint = hint(verdict.first_divergence, ref, got, case.world_size, case.init)
    return verdict


def check_case(
    case: Case, pool: RankPool | None = None, timeout_s: float | None = None, calibrate: bool = True
) -> Verdict:
    """Raises RankFailure when a rank crashes or hangs (the pool recovers on the next case)."""
    pool = pool or get_pool(case.world_size)
    t0 = time.perf_counter()
    pool.submit(case)
    try:
        ref = train_reference(case)  # overlaps with the ranks' work
    except BaseException:
        pool.result(timeout_s)  # keep the pool in step before propagating
        raise
    t1 = time.perf_counter()
    got = pool.result(timeout_s)
    t2 = time.perf_counter()
    verdict = judge(case, ref, got, calibrate)
    verdict.seconds = {"reference": t1 - t0, "sharded_wait": t2 - t1, "compare": time.perf_counter() - t2}
    return verdict


# ---- in place, under torchrun --------------------------------------------------------------------
def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "LOCAL_RANK" in os.environ


def check_in_place(case: Case, calibrate: bool = True) -> tuple[Verdict | None, bool]:
    """Every rank runs the sharded side in this very process (PyTorch's launcher started us);
    rank 0 also runs the reference and judges. Returns (the verdict on rank 0, None elsewhere;
    whether rank 0 found the runs equivalent) on every rank."""
    from verify.sharded import RankContext, run_sharded
    from verify.worker import MeshCache, device_for

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world != case.world_size:
        raise ValueError(f"world_size: the case says {case.world_size}, torchrun started {world} ranks")
    device, backend = device_for(int(os.environ["LOCAL_RANK"]))
    if not dist.is_initialized():
        dist.init_process_group(backend)
    mesh = MeshCache(device.type).get(case.mesh)
    got = run_sharded(case, RankContext(rank, world, device, mesh))
    verdict = judge(case, train_reference(case), got, calibrate) if rank == 0 else None
    code = torch.tensor([0 if verdict is None or verdict.ok else 1], device=device)
    dist.broadcast(code, src=0)  # every rank exits with rank 0's verdict
    return verdict, code.item() == 0
