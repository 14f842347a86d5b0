"""What tensor parallelism costs a check: the same model, steps and ranks checked plain (every rank
data-parallel) and with tp (docs/tensor-parallel.md), on warm pools, in one run. Each row is the
median over `--repeats` checks of the whole check and of its two sides: the reference (which runs
every tp rank's share of each op side by side, reference/tensor_parallel.py) and the wait for the
ranks (DTensor's redistributions, 2-D gathers of the records). Calibration is off: a correct
engine's tp records are exact, so a check never calibrates.

    python bench/tensor_parallel.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

from fsdp_verify.case import Case, ModelSpec
from fsdp_verify.case_specs import DataSpec
from fsdp_verify.runner import check_case

MODEL = ModelSpec(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_hidden=48, seq_len=8)


def cases(world: int) -> dict[str, Case]:
    base = Case(model=MODEL, world_size=world, steps=3, data=DataSpec(batch_size=2 * world))
    tp = base.with_(tp=2)
    return {
        f"plain, {world} data-parallel ranks": base,
        f"tp 2 x dp {world // 2}": tp,
        f"tp 2 x dp {world // 2}, +SP +loss parallel": tp.with_(sequence_parallel=True, loss_parallel=True),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    args = p.parse_args()
    print(f"{'case':40s} {'check s':>8s} {'ratio':>6s} {'reference s':>12s} {'ranks s':>8s}")
    for world in args.world_sizes:
        baseline = None
        for label, case in cases(world).items():
            check_case(case, calibrate=False)  # warm the pool and the caches
            totals, refs, ranks = [], [], []
            for _ in range(args.repeats):
                t = time.perf_counter()
                verdict = check_case(case, calibrate=False)
                totals.append(time.perf_counter() - t)
                refs.append(verdict.seconds["reference"])
                ranks.append(verdict.seconds["sharded_wait"])
                assert verdict.ok, verdict.summary()
            total = statistics.median(totals)
            baseline = baseline or total
            print(
                f"{label:40s} {total:8.3f} {total / baseline:6.2f} {statistics.median(refs):12.3f}"
                f" {statistics.median(ranks):8.3f}"
            )


if __name__ == "__main__":
    main()
