"""Warm rank pool vs fresh processes per case vs PyTorch's in-process threaded process group.

One tiny world-size-2 case (3-layer MLP, 3 steps), the sharded side only, measured side by side
in one run; plus the full check (reference + sharded + compare) on the warm pool, and cases per
minute. Ratios are what count: absolute times depend on the machine and its load.

    python bench/pool_vs_cold.py [--warm 30] [--cold 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch
import torch.distributed as dist

from fsdp_verify.case import Case, DataSpec, ModelSpec
from fsdp_verify.runner import check_case
from fsdp_verify.sharded.pool import RankPool

CASE = Case(model=ModelSpec(kind="mlp", widths=(16, 33, 17, 8)), world_size=2, steps=3, data=DataSpec(batch_size=8))


def bench_warm(n: int) -> tuple[list[float], list[float]]:
    with RankPool(2) as pool:
        pool.run(CASE)  # start + warm-up
        sharded = []
        for _ in range(n):
            t = time.perf_counter()
            pool.run(CASE)
            sharded.append(time.perf_counter() - t)
        full = []
        for _ in range(n):
            t = time.perf_counter()
            assert check_case(CASE, pool=pool).ok
            full.append(time.perf_counter() - t)
    return sharded, full


def bench_cold(n: int) -> list[float]:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        with RankPool(2) as pool:
            pool.run(CASE)
        times.append(time.perf_counter() - t)
    return times


def bench_threaded(n: int) -> list[float]:
    """PyTorch's test harness process group: ranks are threads of this process."""
    from torch.testing._internal.distributed.multi_threaded_pg import _install_threaded_pg, _uninstall_threaded_pg

    from fsdp_verify.sharded.loop import RankContext, run_sharded
    from fsdp_verify.sharded.worker import MeshCache

    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    _install_threaded_pg()
    store = dist.HashStore()
    barrier = threading.Barrier(2)
    times: list[float] = []
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            dist.init_process_group("threaded", rank=rank, world_size=2, store=store)
            ctx = RankContext(rank, 2, torch.device("cpu"), MeshCache("cpu").get((2,)))
            for i in range(n + 1):
                barrier.wait()
                t = time.perf_counter()
                run_sharded(CASE, ctx)
                barrier.wait()
                if rank == 0 and i > 0:  # the first case warms up
                    times.append(time.perf_counter() - t)
            dist.destroy_process_group()
        except BaseException as e:  # report, don't hang the other thread
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    _uninstall_threaded_pg()
    torch._C._distributed_c10d._set_thread_isolation_mode(False)
    if errors:
        raise errors[0]
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--warm", type=int, default=30)
    parser.add_argument("--cold", type=int, default=3)
    parser.add_argument("--json", type=str)
    args = parser.parse_args()
    warm, full = bench_warm(args.warm)
    threaded = bench_threaded(args.warm)
    cold = bench_cold(args.cold)
    med = statistics.median
    result = {
        "case": "mlp 16-33-17-8, world size 2, 3 steps, fp32",
        "warm_pool_sharded_s": med(warm),
        "warm_pool_full_check_s": med(full),
        "threaded_pg_sharded_s": med(threaded),
        "cold_spawn_sharded_s": med(cold),
        "cold_over_warm": med(cold) / med(warm),
        "threaded_over_warm": med(threaded) / med(warm),
        "full_checks_per_minute_warm": 60.0 / med(full),
    }
    for k, v in result.items():
        print(f"{k:30s} {v if isinstance(v, str) else f'{v:.4g}'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
