"""Seconds per check: a tiny transformers Llama (a user's model through the factory path) against
the built-in Transformer of about the same size, on one warm rank pool, interleaved so machine
load hits both alike. Reports the median full check (reference + sharded + compare) per case.

    python bench/user_model.py [--repeats 10] [--world-size 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from fsdp_verify.case import Case, ModelSpec
from fsdp_verify.case_specs import DataSpec
from fsdp_verify.runner import check_case
from fsdp_verify.sharded.pool import RankPool


def cases(world_size: int) -> dict[str, Case]:
    data = DataSpec(batch_size=4 * world_size, padded=True)
    common = dict(world_size=world_size, steps=2, microbatches=2, data=data)
    llama = ModelSpec(kind="custom", factory="fsdp_verify.models.hf:tiny_llama", seq_len=8)
    # Llama: width 16, 2 layers, 2 heads (1 KV head), MLP 24, vocab 61, untied: 5,856 parameters.
    builtin = ModelSpec(kind="transformer", vocab_size=61, dim=16, n_layers=2, n_heads=2, ffn_hidden=24, seq_len=8)
    return {
        "tiny_llama (transformers)": Case(model=llama, wrap=("LlamaDecoderLayer", ""), **common),
        "built-in transformer": Case(model=builtin, **common),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args()
    named = cases(args.world_size)
    times: dict[str, list[float]] = {name: [] for name in named}
    with RankPool(args.world_size) as pool:
        for case in named.values():  # warm-up: imports, first builds
            assert check_case(case, pool).ok
        for _ in range(args.repeats):
            for name, case in named.items():
                t0 = time.perf_counter()
                verdict = check_case(case, pool)
                times[name].append(time.perf_counter() - t0)
                assert verdict.ok, verdict.summary()
    params = {}
    from fsdp_verify.models import build_model

    for name, case in named.items():
        params[name] = sum(p.numel() for p in build_model(case.model, 0).parameters())
    print(f"world size {args.world_size}, 2 steps, 2 micro-batches, padded, {args.repeats} repeats (median s/check)")
    for name, ts in times.items():
        print(f"  {name:28s} {params[name]:6d} params  {statistics.median(ts):.3f} s  (min {min(ts):.3f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"times": times, "params": params}, f, indent=2)


if __name__ == "__main__":
    main()
