"""Warm rank pool vs fresh processes per case vs PyTorch's in-process threaded process group.

One tiny world-size-2 case (3-layer MLP, 3 steps), the sharded side only, measured side by side
in one run; plus the full check (reference + sharded + compare) on the warm pool, and cases per
minute. Ratios are what count: absolute times depend on the machine and its load.

    python bench/pool_vs_cold.py [--warm 30] [--cold 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import threading
import time

import torch
import torch.distributed as dist
from _hygiene import private_tmp

from fsdp_verify.case import Case, ModelSpec
from fsdp_verify.case_specs import DataSpec
from fsdp_verify.runner import check_case
from fsdp_verify.sharded.pool import RankPool

CASE = Case(model=ModelSpec(kind="mlp", widths=(16, 33, 17, 8)), world_size=2, steps=3, data=DataSpec(batch_size=8))


def bench_interleaved(n: int, rounds: int = 5) -> tuple[list[float], list[float], list[float]]:
    """The warm pool's sharded side, the full check on it, and the threaded process group, in
    alternating rounds of n // rounds cases each, so that the machine's load hits all three alike."""
    per_round = max(1, n // rounds)
    warm: list[float] = []
    full: list[float] = []
    with RankPool(2) as pool, ThreadedRanks(2) as threaded:
        pool.run(CASE)  # start + warm-up
        assert check_case(CASE, pool=pool).ok
        threaded.run(1)
        for _ in range(rounds):
            for _ in range(per_round):
                t = time.perf_counter()
                pool.run(CASE)
                warm.append(time.perf_counter() - t)
            threaded.run(per_round)
            for _ in range(per_round):
                t = time.perf_counter()
                assert check_case(CASE, pool=pool).ok
                full.append(time.perf_counter() - t)
        return warm, full, threaded.times[1:]  # the first warms up


def bench_cold(n: int) -> list[float]:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        with RankPool(2) as pool:
            pool.run(CASE)
        times.append(time.perf_counter() - t)
    return times


class ThreadedRanks:
    """PyTorch's test harness process group: ranks are threads of this process, kept alive between
    rounds (as the pool's processes are)."""

    def __init__(self, world_size: int, fn=None):
        from fsdp_verify.sharded.loop import run_sharded

        self.world_size, self.fn = world_size, fn or run_sharded
        self.times: list[float] = []
        self._errors: list[BaseException] = []
        self._todo = 0
        self._go = threading.Barrier(world_size + 1)
        self._done = threading.Barrier(world_size + 1)

    def __enter__(self) -> ThreadedRanks:
        from torch.testing._internal.distributed.multi_threaded_pg import _install_threaded_pg

        torch._C._distributed_c10d._set_thread_isolation_mode(True)
        _install_threaded_pg()
        self._store = dist.HashStore()
        self._sync = threading.Barrier(self.world_size)
        self._threads = [threading.Thread(target=self._rank_main, args=(r,)) for r in range(self.world_size)]
        for t in self._threads:
            t.start()
        return self

    def run(self, n: int) -> None:
        self._todo = n
        self._go.wait()
        self._done.wait()
        if self._errors:
            raise self._errors[0]

    def __exit__(self, *exc) -> None:
        from torch.testing._internal.distributed.multi_threaded_pg import _uninstall_threaded_pg

        self._todo = -1
        self._go.wait()
        for t in self._threads:
            t.join()
        _uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        gc.collect()

    def _rank_main(self, rank: int) -> None:
        from fsdp_verify.sharded.loop import RankContext
        from fsdp_verify.sharded.worker import MeshCache

        try:
            dist.init_process_group("threaded", rank=rank, world_size=self.world_size, store=self._store)
            ctx = RankContext(rank, self.world_size, torch.device("cpu"), MeshCache("cpu").get((self.world_size,)))
            while True:
                self._go.wait()
                if self._todo < 0:
                    break
                for _ in range(self._todo):
                    self._sync.wait()
                    t = time.perf_counter()
                    self.fn(CASE, ctx)
                    self._sync.wait()
                    if rank == 0:
                        self.times.append(time.perf_counter() - t)
                self._done.wait()
            dist.destroy_process_group()
        except BaseException as e:  # report, don't hang the other threads
            self._errors.append(e)
            self._sync.abort()
            self._go.abort()
            self._done.abort()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--warm", type=int, default=30)
    parser.add_argument("--cold", type=int, default=3)
    parser.add_argument("--json", type=str)
    args = parser.parse_args()
    with private_tmp("pool-vs-cold"):
        warm, full, threaded = bench_interleaved(args.warm)
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
