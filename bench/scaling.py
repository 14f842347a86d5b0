"""How a full check's cost grows: seconds per check (`check_case` on a warm pool: the reference in
this process overlapping the ranks, then comparing) against the number of parameters (4 MLP
sizes), steps (1, 10, 100) and world size (1-4), each varied alone from the tiny case of
bench/pool_vs_cold.py (mlp 16-33-17-8, world size 2, 3 steps) with a batch of 12 (divisible by
every world size). Also rank 0's recording cost per
step (its "record + gather" phases, verify/sharded/worker.py PhaseClock, over the steps). Medians
of --repeats; within a sweep the points are measured in rounds, so load hits them alike.
Writes a table (stdout, --json) and an inline SVG plot (--svg; matplotlib is not a dependency).

    python bench/scaling.py [--repeats 3] [--svg scaling.svg] [--json scaling.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

from _hygiene import private_tmp

from fsdp_verify.case import Case, ModelSpec
from fsdp_verify.case_specs import DataSpec
from fsdp_verify.reports.plots import line_chart
from fsdp_verify.runner import check_case
from fsdp_verify.sharded.pool import RankPool

BASE = Case(model=ModelSpec(kind="mlp", widths=(16, 33, 17, 8)), world_size=2, steps=3, data=DataSpec(batch_size=12))
WIDTHS = {
    "tiny": (16, 33, 17, 8),
    "small": (64, 128, 64, 8),
    "medium": (256, 512, 256, 8),
    "large": (1024, 1024, 1024, 8),
}
STEPS = (1, 10, 100)
WORLD_SIZES = (1, 2, 3, 4)


def n_params(widths: tuple[int, ...]) -> int:
    return sum(a * b + b for a, b in zip(widths, widths[1:]))


def with_model(widths: tuple[int, ...]) -> Case:
    return dataclasses.replace(BASE, model=dataclasses.replace(BASE.model, widths=widths))


def measure(cases: dict[str, Case], repeats: int, pools: dict[int, RankPool]) -> dict[str, dict[str, float]]:
    times: dict[str, list[float]] = {k: [] for k in cases}
    record: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(repeats):
        for label, case in cases.items():
            pool = pools.setdefault(case.world_size, RankPool(case.world_size))
            t = time.perf_counter()
            verdict = check_case(case, pool=pool)
            times[label].append(time.perf_counter() - t)
            assert verdict.ok, verdict.summary()
            record[label].append(sum(v for k, v in pool.last_profile.items() if k.startswith("record + gather")))
    return {
        k: {
            "seconds": statistics.median(times[k]),
            "record_per_step_s": statistics.median(record[k]) / cases[k].steps,
        }
        for k in cases
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--svg", type=str, default="scaling.svg")
    parser.add_argument("--json", type=str)
    args = parser.parse_args()
    sweeps = {
        "parameters": {f"{n_params(w)}": with_model(w) for w in WIDTHS.values()},
        "steps": {str(s): dataclasses.replace(BASE, steps=s) for s in STEPS},
        "world size": {str(w): dataclasses.replace(BASE, world_size=w) for w in WORLD_SIZES},
    }
    with private_tmp("scaling"):
        pools: dict[int, RankPool] = {}
        try:
            for pool_ws in sorted({c.world_size for s in sweeps.values() for c in s.values()}):
                pools[pool_ws] = RankPool(pool_ws)
                check_case(BASE if pool_ws == 2 else dataclasses.replace(BASE, world_size=pool_ws), pool=pools[pool_ws])
            results = {name: measure(cases, args.repeats, pools) for name, cases in sweeps.items()}
        finally:
            for pool in pools.values():
                pool.close()
    print(
        f"base case: mlp {BASE.model.widths}, world size {BASE.world_size}, {BASE.steps} steps, "
        f"batch {BASE.data.batch_size}; one thing varied"
    )
    print(f"{'varied':12s} {'value':>9s} {'s / check':>10s} {'record ms / step (rank 0)':>26s}")
    for name, rows in results.items():
        for value, row in rows.items():
            print(f"{name:12s} {value:>9s} {row['seconds']:10.3f} {1000 * row['record_per_step_s']:26.2f}")
    steps = results["steps"]
    slope = (steps["100"]["seconds"] - steps["1"]["seconds"]) / 99
    print(f"marginal cost of a step (1 -> 100 steps): {1000 * slope:.1f} ms a step")
    charts = [
        line_chart(
            {"s / check": [(i, r["seconds"]) for i, r in enumerate(rows.values())]},
            [f"{name} {v}" if i == 0 else v for i, v in enumerate(rows)],
            name=f"scaling-{name.replace(' ', '-')}",
            threshold=None,
            height=220,
        )
        for name, rows in results.items()
    ]
    height = 230 * len(charts)
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="760" height="{height}" font-family="sans-serif">']
    for i, chart in enumerate(charts):
        svg.append(chart.replace("<svg ", f'<svg y="{230 * i}" ', 1))
    svg.append("</svg>")
    with open(args.svg, "w") as f:
        f.write("\n".join(svg))
    print(f"plot: {args.svg}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**results, "marginal_step_s": slope}, f, indent=2)


if __name__ == "__main__":
    main()
