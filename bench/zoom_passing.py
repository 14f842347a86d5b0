"""Zoom on fresh-seed passing cases must name nothing (docs/zoom.md): draws FSDP2 cases from the
property strategy, distinct ones, drawn under Hypothesis seed --seed, checks each and zooms into its last step.
Prints one line a case and the tally (the zoom's seconds against the checks', one run); exit 1 if
any zoom named a module on a passing case. `--tp 2` / `--ep 2` / `--pp 2` draw every case with
tensor, expert or pipeline parallelism (docs/zoom.md#beside-tensor-expert-and-pipeline-parallelism)."""

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
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--tp", type=int, nargs="+", help="tp degrees to draw among (every case)")
    p.add_argument("--ep", type=int, nargs="+", help="ep degrees to draw among (every case)")
    p.add_argument("--pp", type=int, nargs="+", help="pp degrees to draw among (every case)")
    args = p.parse_args()
    pins = {name: st.sampled_from(getattr(args, name)) for name in ("tp", "ep", "pp") if getattr(args, name)}
    tally = {"cases": 0, "passing": 0, "named": 0, "check_s": 0.0, "zoom_s": 0.0}
    drawn: dict[str, object] = {}

    @seed(args.seed)
    @settings(
        max_examples=args.count * 3,
        database=None,
        derandomize=False,
        deadline=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(cases(world_sizes=tuple(args.world_sizes), steps=st.integers(1, 2), **pins))
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
    tally["zoom/check"] = round(tally["zoom_s"] / tally["check_s"], 2) if tally["check_s"] else None
    print(tally, flush=True)
    return 1 if tally["named"] else 0


if __name__ == "__main__":
    sys.exit(main())
