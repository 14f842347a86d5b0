"""What FSDP2 alone costs on the tiny case, in rank processes on gloo and in threads of PyTorch's
threaded process group, beside the toolkit's full sharded run in both, in one run.

bench/pool_vs_cold.py holds the pool to 1.5x faster than the threaded group. This says how much of
either time is FSDP2's own training (the same model, plan, batches and optimizer; no records, no
probes), and so what the toolkit adds in each: in processes the ranks' Python runs in parallel
but every collective is a gloo round trip (bench/gloo_floor.py); in threads the collectives are
memory copies but the ranks' Python takes turns under the GIL.

    python bench/fsdp2_floor.py [--cases 30]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _hygiene import private_tmp, rendezvous_file
from pool_vs_cold import CASE, ThreadedRanks

from fsdp_verify.case import Case
from fsdp_verify.engines import ShardSpec, resolve_engine
from fsdp_verify.models import build_model
from fsdp_verify.sharded.loop import RankContext, run_sharded
from fsdp_verify.sharded.worker import MeshCache
from fsdp_verify.training.data import as_call, global_batch, microbatch_slices, take
from fsdp_verify.training.loss import global_mean_scale, microbatch_loss
from fsdp_verify.training.optim import make_optimizer


def bare_fsdp2(case: Case, ctx: RankContext) -> None:
    """The case's training under FSDP2 and nothing else: build, shard, steps."""
    model = build_model(case.model, case.seed, case.init, device=ctx.device)
    sharded = resolve_engine("fsdp2")(model, ctx.mesh, ShardSpec.from_case(case))
    optimizer = make_optimizer(case.optim, sharded.parameters())
    scale = global_mean_scale(ctx.world_size, case.data.batch_size)
    for step in range(1, case.steps + 1):
        inputs, targets = global_batch(case, step)
        for index in microbatch_slices(case, ctx.rank):
            args, kwargs = as_call(take(inputs, index, ctx.device))
            microbatch_loss(case, sharded(*args, **kwargs), targets[index], scale).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


RUNS = {"bare FSDP2": bare_fsdp2, "toolkit's sharded run": run_sharded}


def _process_rank(rank: int, init: str, todo, done) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=2)
    ctx = RankContext(rank, 2, torch.device("cpu"), MeshCache("cpu").get((2,)))
    while True:
        job = todo[rank].get()
        if job is None:
            break
        name, n = job
        times = []
        for _ in range(n):
            dist.barrier()
            t = time.perf_counter()
            RUNS[name](CASE, ctx)
            dist.barrier()
            times.append(time.perf_counter() - t)
        if rank == 0:
            done.put(times)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", type=int, default=30)
    args = parser.parse_args()
    rounds, per_round = 5, max(1, args.cases // 5)
    times: dict[tuple[str, str], list[float]] = {}
    with private_tmp("fsdp2-floor") as tmp, rendezvous_file(tmp) as init:
        ctx = mp.get_context("spawn")
        todo, done = [ctx.Queue(), ctx.Queue()], ctx.Queue()
        procs = mp.start_processes(_process_rank, args=(init, todo, done), nprocs=2, join=False, start_method="spawn")
        try:
            for name, fn in RUNS.items():
                with ThreadedRanks(2, fn) as threaded:
                    threaded.run(2)  # warm-up
                    for q in todo:
                        q.put((name, 2))
                    done.get()
                    threaded.times.clear()
                    for _ in range(rounds):
                        for q in todo:
                            q.put((name, per_round))
                        times.setdefault(("processes", name), []).extend(done.get())
                        threaded.run(per_round)
                    times[("threads", name)] = list(threaded.times)
        finally:
            for q in todo:
                q.put(None)
            procs.join()
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"case: {CASE.model.kind} {CASE.model.widths}, world size 2, {CASE.steps} steps; medians, ms")
    print(f"{'':26s} {'processes (gloo)':>17s} {'threads':>9s} {'threads / processes':>20s}")
    for name in RUNS:
        p, t = med[("processes", name)], med[("threads", name)]
        print(f"{name:26s} {p * 1e3:17.1f} {t * 1e3:9.1f} {t / p:20.2f}")
    p = med[("processes", "toolkit's sharded run")] - med[("processes", "bare FSDP2")]
    t = med[("threads", "toolkit's sharded run")] - med[("threads", "bare FSDP2")]
    print(f"{'toolkit adds':26s} {p * 1e3:17.1f} {t * 1e3:9.1f}")


if __name__ == "__main__":
    main()
