"""Where a full check's time goes, per phase, on the tiny world-size-2 case of bench/pool_vs_cold.py.

Rank 0 times its own phases (verify/sharded/worker.py PhaseClock: decode case, mesh, build,
fully_shard, training, record + gather, probes, releasing groups, serialising the trace); this
side times dispatch (sending the case and receiving the trace, less what rank 0 was busy),
decoding the trace, the reference, comparing, the checks and calibration. Two passes, interleaved
case by case: the sharded side alone (`pool.run`, which isolates dispatch), and the full check as
`check_case` runs it (the reference overlaps the ranks). Medians in milliseconds; the machine's
load moves absolute numbers, so read shares and ratios.

    python bench/profile_check.py [--cases 40] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from fsdp_verify.case import Case, ModelSpec
from fsdp_verify.case_specs import DataSpec
from fsdp_verify.runner import emulating_reference, judge
from fsdp_verify.sharded.pool import RankPool
from fsdp_verify.training.threads import rank_like_threads

CASE = Case(model=ModelSpec(kind="mlp", widths=(16, 33, 17, 8)), world_size=2, steps=3, data=DataSpec(batch_size=8))

RANK_ROWS = (
    "decode case",
    "mesh",
    "build model",
    "fully_shard (engine)",
    "probes",
    "training",
    "record + gather",  # the sum of its parts, below
    "finish",
    "release groups",
    "serialise trace",
)


def profile(n: int, case: Case = CASE) -> dict[str, float]:
    rows: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        rows.setdefault(name, []).append(value)

    with RankPool(case.world_size) as pool:
        pool.run(case)  # start + warm-up
        for _ in range(n):
            # The sharded side alone: what dispatch costs beyond rank 0's own work.
            t = time.perf_counter()
            pool.run(case)
            wall = time.perf_counter() - t
            prof = pool.last_profile
            prof["record + gather"] = sum(v for k, v in prof.items() if k.startswith("record + gather: "))
            parent = ("receive trace", "decode trace")
            busy = sum(v for k, v in prof.items() if k not in (*parent, "record + gather"))
            for k in RANK_ROWS:
                add(f"rank 0: {k}", prof.get(k, 0.0))
            for k in sorted(prof):
                if k.startswith("record + gather: "):
                    add(f"rank 0:   {k}", prof[k])
            add("dispatch (sharded wall - rank 0 busy - receive - decode)", wall - busy - sum(prof[k] for k in parent))
            add("receive trace (pipe)", prof["receive trace"])
            add("decode trace", prof["decode trace"])
            add("sharded side alone (wall)", wall)

            # The full check, as check_case runs it.
            t0 = time.perf_counter()
            pool.submit(case)
            with rank_like_threads():
                ref = emulating_reference(case)
            t1 = time.perf_counter()
            got = pool.result()
            t2 = time.perf_counter()
            verdict = judge(case, ref, got)
            t3 = time.perf_counter()
            assert verdict.ok, verdict.summary()
            add("reference (overlaps the ranks)", t1 - t0)
            add("wait for the ranks after the reference", t2 - t1)
            add("compare", verdict.seconds["compare"])
            add("checks", verdict.seconds["checks"])
            add("calibration", verdict.seconds["calibration"])
            add("full check (wall)", t3 - t0)
    med = {k: statistics.median(v) for k, v in rows.items()}
    med["full checks per minute"] = 60.0 / med["full check (wall)"]
    return med


def print_table(med: dict[str, float]) -> None:
    print(f"{'phase':58s} {'median ms':>10s}")
    for k, v in med.items():
        if k == "full checks per minute":
            print(f"{k:58s} {v:10.0f}")
        else:
            print(f"{k:58s} {1000 * v:10.2f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", type=int, default=40)
    parser.add_argument("--json", type=str)
    args = parser.parse_args()
    med = profile(args.cases)
    print(f"case: {CASE.model.kind} {CASE.model.widths}, world size {CASE.world_size}, {CASE.steps} steps")
    print_table(med)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(med, f, indent=2)


if __name__ == "__main__":
    main()
