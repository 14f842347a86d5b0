"""What verification costs on a medium model: bare training vs the same training verified.

bare     = a plain single-process training loop (the reference without records)
         + the sharded training loop without any gathering or recording
verified = the recording reference (reference/trainer.py; its emulated ranks split over the two
           processes as under torchrun, verify/sharded/shared_reference.py) + the recording
           sharded loop (verify/sharded/loop.py) + comparing the traces
Measured in the same two rank processes, one after the other, after a warm-up.
Target: verified / bare <= 1.3.

    python bench/overhead.py [--repeats 7] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _hygiene import private_tmp

from fsdp_verify.case import Case, ModelSpec
from fsdp_verify.case_specs import DataSpec
from fsdp_verify.engines import ShardSpec, resolve_engine
from fsdp_verify.models import build_model
from fsdp_verify.runner import judge
from fsdp_verify.sharded.allocator import keep_freed_memory
from fsdp_verify.sharded.arena import release_arenas
from fsdp_verify.sharded.loop import RankContext, run_sharded
from fsdp_verify.sharded.pool import memory_dir
from fsdp_verify.sharded.torchrun import reference_in_place
from fsdp_verify.sharded.worker import MeshCache, exit_now, leave_process_group
from fsdp_verify.training.data import global_batch, microbatch_slices
from fsdp_verify.training.loss import loss_fn
from fsdp_verify.training.optim import make_optimizer

MEDIUM = Case(
    model=ModelSpec(kind="transformer", vocab_size=512, dim=128, n_layers=4, n_heads=4, ffn_hidden=344, seq_len=64),
    world_size=2,
    steps=4,
    data=DataSpec(batch_size=8),
)


def bare_sharded(case: Case, mesh) -> None:
    model = resolve_engine(case.engine)(build_model(case.model, case.seed), mesh, ShardSpec.from_case(case))
    optimizer = make_optimizer(case.optim, model.parameters())
    for step in range(1, case.steps + 1):
        inputs, targets = global_batch(case, step)
        for index in microbatch_slices(case, dist.get_rank()):
            (loss_fn(case.model, model(inputs[index]), targets[index]) / case.microbatches).backward()
        optimizer.step()
        optimizer.zero_grad()


def bare_reference(case: Case) -> None:
    model = build_model(case.model, case.seed)
    optimizer = make_optimizer(case.optim, model.parameters())
    for step in range(1, case.steps + 1):
        inputs, targets = global_batch(case, step)
        loss_fn(case.model, model(inputs), targets).backward()
        optimizer.step()
        optimizer.zero_grad()


def verify(case: Case, got, spill_dir: str | None) -> None:
    """On every rank, as `check_in_place` runs it: the reference split over the ranks
    (verify/sharded/shared_reference.py), then rank 0 judges."""
    ref, _ = reference_in_place(case, spill_dir)
    if dist.get_rank() == 0:
        verdict = judge(case, ref, got)
        assert verdict.ok, verdict.summary()


def timed(fn) -> float:
    dist.barrier()
    t = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t


def rank_main(rank: int, store_path: str, repeats: int, out_path: str, spill_dir: str | None) -> None:
    keep_freed_memory()  # as a rank under torchrun does (verify/sharded/torchrun.py): bare and verified alike
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2)
    mesh = MeshCache("cpu").get((2,))
    case, ctx = MEDIUM, RankContext(rank, 2, torch.device("cpu"), mesh, spill_dir=spill_dir)
    rows = []
    for i in range(repeats + 1):
        row = {
            "bare_sharded": timed(lambda: bare_sharded(case, ctx.mesh)),
            "bare_reference": timed(lambda: rank == 0 and bare_reference(case)),
        }
        holder: dict = {}
        row["verified_sharded"] = timed(lambda h=holder: h.update(got=run_sharded(case, ctx)))
        row["verified_reference_and_compare"] = timed(lambda h=holder: verify(case, h["got"], spill_dir))
        if i > 0:  # the first round warms up
            rows.append(row)
    if rank == 0:
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        bare = med["bare_sharded"] + med["bare_reference"]
        verified = med["verified_sharded"] + med["verified_reference_and_compare"]
        # Each round's own ratio too: bare and verified a second apart see the same machine
        # (neighbours on a shared host move both by a third within minutes).
        rounds = [
            (r["verified_sharded"] + r["verified_reference_and_compare"]) / (r["bare_sharded"] + r["bare_reference"])
            for r in rows
        ]
        result = {
            **{f"{k}_s": v for k, v in med.items()},
            "bare_s": bare,
            "verified_s": verified,
            "ratio": verified / bare,
            "ratio_per_round_median": statistics.median(rounds),
            "ratio_per_round_min": min(rounds),
            "ratio_per_round_max": max(rounds),
        }
        with open(out_path, "w") as f:
            json.dump(result, f, indent=2)
    release_arenas()
    leave_process_group()  # groups freed while the interpreter is alive, then no finalisation:
    exit_now(0)  # the SIGABRT at exit (verify/sharded/worker.py leave_process_group)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", type=str)
    args = parser.parse_args()
    with private_tmp("overhead"), tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        # The pieces travel as files in memory, as in a pool (verify/sharded/collect.py).
        spill = memory_dir()
        mp.spawn(rank_main, args=(os.path.join(tmp, "store"), args.repeats, out, spill), nprocs=2)
        with open(out) as f:
            result = json.load(f)
    print(f"case: {MEDIUM.model}")
    for k, v in result.items():
        print(f"{k:36s} {v:.4g}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
