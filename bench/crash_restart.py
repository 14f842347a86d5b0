"""What a case that crashes a rank costs, against a passing case on a warm pool and a cold start.

A search shrinking a failure that crashes ranks runs crash after crash (issue 38: 8 min 51 s to
report). Each crash ends the process group, so the pool stops its ranks and forks new ones from
its zygote (verify/sharded/zygote.py) for the next case; a cold start (a new pool: the zygote
imports torch) is what each restart cost before the zygote. Measured side by side in rounds, the
one tiny world-size-2 case each time (a 3-layer MLP, one step), the full check:

- warm: a passing case on a warm pool;
- crash step: a case whose rank 1 aborts (SIGABRT) in its forward, then the next passing case on
  the restarted pool (what one crashing shrink step costs, detection and restart included);
- cold: a new pool and its first case.

    python bench/crash_restart.py [--rounds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from _hygiene import private_tmp

from fsdp_verify.case import Case, ModelSpec
from fsdp_verify.case_specs import DataSpec, PrecisionSpec
from fsdp_verify.runner import check_case
from fsdp_verify.sharded.pool import RankFailure, RankPool

ENGINE = str(Path(__file__).resolve().parents[1] / "tests" / "engines" / "faulty.py") + ":rank1_aborts_with_bf16_params"
PASSING = Case(
    model=ModelSpec(kind="mlp", widths=(4, 5, 3)), world_size=2, steps=1, data=DataSpec(batch_size=4), engine=ENGINE
)
CRASHING = Case(
    model=PASSING.model,
    world_size=2,
    steps=1,
    data=PASSING.data,
    engine=ENGINE,
    precision=PrecisionSpec(param_dtype="bf16", reduce_dtype="fp32"),
)


def crash_step(pool: RankPool) -> float:
    t = time.perf_counter()
    try:
        check_case(CRASHING, pool=pool)
    except RankFailure:
        pass
    else:
        raise AssertionError("the crashing case passed")
    assert check_case(PASSING, pool=pool).ok
    return time.perf_counter() - t


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", type=str)
    args = parser.parse_args()
    warm, crash, cold = [], [], []
    with private_tmp("crash-restart"), RankPool(2) as pool:
        assert check_case(PASSING, pool=pool).ok  # start + warm-up
        crash_step(pool)  # the first restart warms the zygote's side too
        for _ in range(args.rounds):
            t = time.perf_counter()
            assert check_case(PASSING, pool=pool).ok
            warm.append(time.perf_counter() - t)
            crash.append(crash_step(pool))
            t = time.perf_counter()
            with RankPool(2) as fresh:
                assert check_case(PASSING, pool=fresh).ok
            cold.append(time.perf_counter() - t)
    med = {name: statistics.median(v) for name, v in (("warm", warm), ("crash step", crash), ("cold", cold))}
    for name, v in med.items():
        print(f"{name:>11}: median {v:.2f} s")
    print(
        f"a crash step is {med['crash step'] / med['warm']:.1f}x a warm case; a cold start {med['cold'] / med['crash step']:.1f}x a crash step"
    )
    if args.json:
        Path(args.json).write_text(
            json.dumps({"median_s": med, "warm": warm, "crash_step": crash, "cold": cold}, indent=2)
        )


if __name__ == "__main__":
    main()
