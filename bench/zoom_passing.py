"""Zoom on fresh-seed passing cases must name nothing (docs/zoom.md): draws FSDP2 cases from the
property strategy, distinct ones, drawn under Hypothesis seed --seed, checks each and zooms into its last step.
Prints one line a case and the tally; exit 1 if any zoom named a module on a passing case."""

from __future__ import annotations

import argparse
import sys
import time

from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from fsdp_verify.properties.strategies import cases
from fsdp_verify.runner import check_case
from fsdp_verify.zoom.locate import zoom


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--seed", type=int, default=20263001)
    p.add_argument("--count", type=int, default=200)
    args = p.parse_args()
    tally = {"cases": 0, "passing": 0, "named": 0, "check_s": 0.0, "zoom_s": 0.0}
    drawn: dict[str, object] = {}

    @seed(args.seed)
    @settings(max_examples=args.count * 3, database=None, derandomize=False, suppress_health_check=list(HealthCheck))
    @given(cases(world_sizes=(1, 2, 3), steps=st.integers(1, 2)))
    def draw(case):
        if len(drawn) < args.count:
            drawn.setdefault(case.hash, case)

    draw()
    for s, case in enumerate(drawn.values(), start=args.seed):
        tally["cases"] += 1
        t = time.perf_counter()
        verdict = check_case(case)
        tally["check_s"] += time.perf_counter() - t
        if not verdict.ok:
            print(
                f"#{s - args.seed}: case {case.hash} does not pass ({verdict.summary()[:120]}); not zoomed", flush=True
            )
            continue
        tally["passing"] += 1
        t = time.perf_counter()
        result = zoom(case, verdict, step=case.steps)
        tally["zoom_s"] += time.perf_counter() - t
        tally["named"] += result.named
        print(f"#{s - args.seed}: case {case.hash}: {result.chain()}", flush=True)
    print(tally, flush=True)
    return 1 if tally["named"] else 0


if __name__ == "__main__":
    sys.exit(main())
