"""What a compiled case costs (docs/compile.md): the first compiled case into an empty Inductor
cache (cold), the same case again (warm: its graphs from the cache), a case of other shapes
(new kernels, the cache's headers warm), and the cheaper backends, each against the same case
eager, measured in one run on one warm pool (world size 2). Ratios are what count: absolute times
depend on the machine and its load.

    python bench/compile.py [--repeat 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

from _hygiene import private_tmp

from fsdp_verify.case import Case, ModelSpec
from fsdp_verify.case_specs import DataSpec
from fsdp_verify.runner import check_case
from fsdp_verify.sharded.pool import RankPool
from fsdp_verify.training.compile import CACHE_ENV

CASE = Case(model=ModelSpec(kind="mlp", widths=(16, 33, 17, 8)), world_size=2, steps=3, data=DataSpec(batch_size=8))
OTHER_SHAPES = CASE.with_(model=ModelSpec(kind="mlp", widths=(12, 29, 7)))


def timed(case: Case, pool: RankPool) -> float:
    t = time.perf_counter()
    verdict = check_case(case, pool=pool)
    assert verdict.ok, verdict.summary()
    return time.perf_counter() - t


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=3, help="warm measurements of each (the median is kept)")
    p.add_argument("--json", help="write the numbers here")
    args = p.parse_args()
    # An empty cache of its own, so the first compiled case is cold; kept outside the private
    # temporary directory, whose check counts what a run leaves behind (a cache is meant to stay).
    os.environ[CACHE_ENV] = cache = tempfile.mkdtemp(prefix="fsdp-verify-bench-inductor-")
    with private_tmp("compile"), RankPool(2) as pool:
        timed(CASE, pool)  # the pool started, the eager path warm
        eager = statistics.median(timed(CASE, pool) for _ in range(args.repeat))
        compiled = CASE.with_(compile="units")
        rows = {"eager": eager, "inductor, cold cache (first case)": timed(compiled, pool)}
        rows["inductor, warm cache (the same case)"] = statistics.median(
            timed(compiled, pool) for _ in range(args.repeat)
        )
        rows["inductor, new shapes (headers warm)"] = timed(OTHER_SHAPES.with_(compile="units"), pool)
        for backend in ("aot_eager", "eager"):
            rows[f"{backend} backend"] = statistics.median(
                timed(CASE.with_(compile="units", compile_backend=backend), pool) for _ in range(args.repeat)
            )
    shutil.rmtree(cache, ignore_errors=True)
    print(f"{'world size 2, 3-layer MLP, 3 steps, compile units':<48} {'seconds':>8} {'x eager':>8}")
    for name, seconds in rows.items():
        print(f"{name:<48} {seconds:8.2f} {seconds / eager:8.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({name: {"seconds": s, "x_eager": s / eager} for name, s in rows.items()}, f, indent=2)


if __name__ == "__main__":
    main()
