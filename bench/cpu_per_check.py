"""CPU time a full check costs, by process, on the tiny case of bench/pool_vs_cold.py, and what
that allows: pools side by side (bench/throughput.py) can run at most cores x 60 s / (CPU a check)
checks a minute. Beside it, in the same run, where FSDP2 alone spends a rank's CPU, by thread: the
interpreter's and gloo's (its TCP loop thread and its work threads), with no toolkit at all.

CPU time moves less with the machine's load than wall time does (bench/throughput.py's counts
moved by a fifth between runs minutes apart), so this is the number to compare releases by.

    python bench/cpu_per_check.py [--cases 60]
"""

from __future__ import annotations

import argparse
import os
import resource
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _hygiene import private_tmp, rendezvous_file
from fsdp2_floor import bare_fsdp2
from pool_vs_cold import CASE

from fsdp_verify.runner import check_case
from fsdp_verify.sharded.loop import RankContext
from fsdp_verify.sharded.pool import RankPool
from fsdp_verify.sharded.worker import MeshCache

TICK = os.sysconf("SC_CLK_TCK")


def _cpu_of(stat_path: str) -> tuple[str, float]:
    """(thread or process name, user + system CPU seconds) from a /proc stat file."""
    with open(stat_path) as f:
        head, tail = f.read().rsplit(")", 1)
    fields = tail.split()
    return head.split("(", 1)[1], (int(fields[11]) + int(fields[12])) / TICK


def _own_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def full_checks(n: int) -> dict[str, float]:
    """CPU seconds a full check takes in each process: the pool's ranks and this one."""
    with RankPool(2) as pool:
        for _ in range(5):  # warm-up
            assert check_case(CASE, pool=pool).ok
        ranks = [f"/proc/{pid}/stat" for pid in pool.pids()]
        before, mine, t = [_cpu_of(p)[1] for p in ranks], _own_cpu(), time.perf_counter()
        for _ in range(n):
            assert check_case(CASE, pool=pool).ok
        wall = time.perf_counter() - t
        after = [_cpu_of(p)[1] for p in ranks]
        out = {f"rank {r}": (b - a) / n for r, (a, b) in enumerate(zip(before, after))}
        out["this process (reference, compare, checks)"] = (_own_cpu() - mine) / n
        out["wall"] = wall / n
        return out


def _threads() -> dict[str, float]:
    """CPU seconds so far of this process's threads, summed by thread name."""
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        name, cpu = _cpu_of(f"/proc/self/task/{tid}/stat")
        out[name] = out.get(name, 0.0) + cpu
    return out


def _bare_rank(rank: int, init: str, n: int, done) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    ctx = RankContext(rank, 2, torch.device("cpu"), MeshCache("cpu").get((2,)))
    for _ in range(5):
        bare_fsdp2(CASE, ctx)
    dist.barrier()
    before = _threads()
    for _ in range(n):
        bare_fsdp2(CASE, ctx)
    dist.barrier()
    after = _threads()
    if rank == 0:
        done.put({k: (v - before.get(k, 0.0)) / n for k, v in after.items()})
    dist.destroy_process_group()


def bare_fsdp2_threads(n: int, tmp: str) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    done = ctx.Queue()
    with rendezvous_file(tmp) as init:
        procs = mp.start_processes(_bare_rank, args=(init, n, done), nprocs=2, join=False, start_method="spawn")
        per_thread = done.get()
        procs.join()
    return per_thread


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", type=int, default=60)
    args = parser.parse_args()
    with private_tmp("cpu-per-check") as tmp:
        check = full_checks(args.cases)
        bare = bare_fsdp2_threads(args.cases, tmp)
    cores = len(os.sched_getaffinity(0))
    total = sum(v for k, v in check.items() if k != "wall")
    print(f"case: {CASE.model.kind} {CASE.model.widths}, world size 2, {CASE.steps} steps; CPU ms a full check")
    for k, v in check.items():
        if k != "wall":
            print(f"  {k:44s} {v * 1e3:7.1f}")
    print(f"  {'all processes':44s} {total * 1e3:7.1f}")
    print(f"  {'wall, one pool':44s} {check['wall'] * 1e3:7.1f}")
    print(f"at most {cores * 60 / total:.0f} full checks a minute on {cores} cores (pools side by side)")
    print("FSDP2 alone, rank 0, CPU ms a case by thread (no toolkit)")
    for name, v in sorted(bare.items(), key=lambda kv: -kv[1]):
        if v * 1e3 >= 0.1:
            print(f"  {name:44s} {v * 1e3:7.1f}")
    print(f"  {'all threads':44s} {sum(bare.values()) * 1e3:7.1f}")


if __name__ == "__main__":
    main()
