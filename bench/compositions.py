"""What a composed case costs against a plain one (issue 40): `check` (calibrated, as a user runs
it) of the same MLP, steps and batch at world size 4, plain FSDP2 and then each composition, in
one run on warm pools, each the median of `--repeats`; the ratio is to the plain case's median.

    python bench/compositions.py [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from _hygiene import private_tmp

from fsdp_verify.case import Case, ModelSpec
from fsdp_verify.case_specs import DataSpec, PrecisionSpec
from fsdp_verify.runner import check_case
from fsdp_verify.sharded.pool import RankPool

WIDTHS = (16, 33, 17, 8)
BASE = {"world_size": 4, "steps": 3, "microbatches": 2, "data": DataSpec(batch_size=32)}


def _moe(**routing) -> ModelSpec:
    return ModelSpec(kind="mlp", widths=WIDTHS, experts=4, **routing)


CASES: dict[str, Case] = {
    "plain (no experts)": Case(model=ModelSpec(kind="mlp", widths=WIDTHS), **BASE),
    "routed experts, per-expert loop": Case(model=_moe(), **BASE),
    "grouped experts top-2, ep 1": Case(model=_moe(top_k=2), **BASE),
    "grouped experts top-2, ep 2": Case(model=_moe(top_k=2), ep=2, **BASE),
    "grouped experts top-2, ep 4": Case(model=_moe(top_k=2), ep=4, **BASE),
    "ep 2 on HSDP (2, 2), bf16": Case(
        model=_moe(top_k=2), ep=2, mesh_shape=(2, 2), precision=PrecisionSpec(param_dtype="bf16"), **BASE
    ),
    "ep 2, capacity 1.0, aux loss, router bias": Case(
        model=_moe(top_k=2, capacity_factor=1.0, aux_loss=0.01, router_bias=0.01), ep=2, **BASE
    ),
    # The stages reduce once a step: beside their baseline, the same case with sync on the last micro-batch.
    "no-sync (the pipelines' baseline)": Case(
        model=ModelSpec(kind="mlp", widths=WIDTHS), sync_every_microbatch=False, **BASE
    ),
    "pp 2, gpipe": Case(
        model=ModelSpec(kind="mlp", widths=WIDTHS), pp=2, pp_schedule="gpipe", sync_every_microbatch=False, **BASE
    ),
    "pp 2, 1f1b": Case(model=ModelSpec(kind="mlp", widths=WIDTHS), pp=2, sync_every_microbatch=False, **BASE),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    seconds: dict[str, float] = {}
    with private_tmp("compositions"), RankPool(4) as pool:
        for name, case in CASES.items():
            verdict = check_case(case, pool=pool)  # warm-up: the pool, the imports
            assert verdict.ok, verdict.summary()
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                check_case(case, pool=pool)
                times.append(time.perf_counter() - t0)
            seconds[name] = statistics.median(times)
    plain = seconds["plain (no experts)"]
    print(f"check, world size 4, 3 steps, 2 micro-batches, median of {args.repeats}:")
    for name, s in seconds.items():
        print(f"  {name:45s} {s * 1000:7.0f} ms  {s / plain:5.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"seconds": seconds, "ratio": {n: s / plain for n, s in seconds.items()}}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
