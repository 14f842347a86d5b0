"""What one zygote for all of a process's pools saves: a sweep over world sizes 1-4 starts four
pools, and each started a zygote of its own (verify/sharded/zygote.py: a process importing torch,
the toolkit and Dynamo before it forks ranks). Measured side by side in alternating rounds: four
pools (world sizes 1-4) started and one tiny case checked on each, their zygote shared (`shared`,
what pools do now) and one each (as before); wall clock and the CPU of the children (zygotes and
ranks).

    python bench/zygote_sharing.py [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

from _hygiene import private_tmp

from fsdp_verify.case import Case, ModelSpec
from fsdp_verify.case_specs import DataSpec
from fsdp_verify.runner import check_case
from fsdp_verify.sharded import zygote
from fsdp_verify.sharded.pool import RankPool

WORLD_SIZES = (1, 2, 3, 4)


def case(world: int) -> Case:
    return Case(
        model=ModelSpec(kind="mlp", widths=(4, 5, 3)), world_size=world, steps=1, data=DataSpec(batch_size=2 * world)
    )


def _one_each(env: dict[str, str], start_timeout_s: float = 300.0) -> zygote.Zygote:
    made = zygote.Zygote(env, start_timeout_s)
    made._users = 1  # released (and stopped) by its one pool
    return made


def four_pools(shared: bool) -> tuple[float, float]:
    """Wall seconds and the children's CPU seconds of four pools, each started and checking a case."""
    saved = zygote.shared
    zygote.shared = saved if shared else _one_each
    before, t = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    try:
        pools = [RankPool(w) for w in WORLD_SIZES]
        try:
            for w, pool in zip(WORLD_SIZES, pools, strict=True):
                assert check_case(case(w), pool=pool).ok
        finally:
            for pool in pools:
                pool.close()
    finally:
        zygote.shared = saved
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return time.perf_counter() - t, cpu


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=str)
    args = parser.parse_args()
    runs: dict[str, list[tuple[float, float]]] = {"one zygote": [], "a zygote per pool": []}
    with private_tmp("zygote-sharing"):
        four_pools(True)  # warm-up: imports, Inductor-free
        for _ in range(args.rounds):
            runs["one zygote"].append(four_pools(True))
            runs["a zygote per pool"].append(four_pools(False))
    med = {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in runs.items()}
    for name, (wall, cpu) in med.items():
        print(f"{name:>18}: median {wall:.2f} s wall, {cpu:.2f} s CPU in children")
    ratio = med["a zygote per pool"][0] / med["one zygote"][0]
    print(f"four pools (world sizes 1-4) start {ratio:.1f}x faster with one zygote")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {k: {"wall_s": w, "children_cpu_s": c} for k, (w, c) in med.items()} | {"ratio": ratio}, f, indent=2
            )


if __name__ == "__main__":
    main()
