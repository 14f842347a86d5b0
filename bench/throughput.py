"""Full checks a minute on the tiny case with 1, 2, ... pools side by side, as `sweep --shard I/N`
runs them (one driver process and its warm world-size-2 pool per shard), in one run.

One check at a time leaves the cores idle while a rank waits on a gloo round trip
(bench/fsdp2_floor.py: FSDP2 alone keeps a rank's core busy about half the time); a second pool
fills those waits. Every driver checks the same case for the same wall-clock window, after all
have warmed up.

    python bench/throughput.py [--pools 1 2 3] [--seconds 20]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time

from _hygiene import private_tmp
from pool_vs_cold import CASE


def _driver(start, stop_at, counts) -> None:
    from fsdp_verify.runner import check_case
    from fsdp_verify.sharded.pool import RankPool

    with RankPool(CASE.world_size) as pool:
        for _ in range(3):  # start + warm-up
            assert check_case(CASE, pool=pool).ok
        start.wait()
        n = 0
        while time.time() < stop_at.value:
            assert check_case(CASE, pool=pool).ok
            n += 1
        counts.put(n)


def checks_per_minute(pools: int, seconds: float) -> float:
    ctx = mp.get_context("spawn")
    start, counts = ctx.Barrier(pools + 1), ctx.Queue()
    stop_at = ctx.Value("d", 0.0)
    drivers = [ctx.Process(target=_driver, args=(start, stop_at, counts)) for _ in range(pools)]
    for d in drivers:
        d.start()
    stop_at.value = 1e18
    start.wait()
    t = time.time()
    stop_at.value = t + seconds
    total = sum(counts.get() for _ in drivers)
    for d in drivers:
        d.join()
    return total / seconds * 60


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pools", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    with private_tmp("throughput"):
        rows = [(k, checks_per_minute(k, args.seconds)) for k in args.pools]
    base = rows[0][1]
    print(f"case: {CASE.model.kind} {CASE.model.widths}, world size 2, {CASE.steps} steps, full checks")
    print(f"{'pools':>5s} {'rank processes':>15s} {'checks a minute':>16s} {'vs ' + str(rows[0][0]) + ' pool':>10s}")
    for k, per_minute in rows:
        print(f"{k:5d} {k * CASE.world_size:15d} {per_minute:16.0f} {per_minute / base:10.2f}")


if __name__ == "__main__":
    main()
