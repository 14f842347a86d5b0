"""The fixed cost under every multi-process case: one gloo collective between two processes,
against a bare socket round trip between the same two, in one run.

A tiny case's ranks spend most of their time waiting on FSDP2's own collectives (9 a step on
bench/pool_vs_cold.py's MLP: 6 all-gathers, 3 reduce-scatters) and the toolkit's (3 a case: the
build digest, the sizes of the pieces, their send), so this ratio, not the model, sets how fast a
warm pool can be against ranks that are threads of one process (bench/pool_vs_cold.py). Two
ranks, 200 floats, `torch.set_num_threads(1)` as in a pool worker; medians of rounds.

    python bench/gloo_floor.py [--iters 500]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _hygiene import private_tmp, rendezvous_file

NUMEL = 200


def _collectives(rank: int, init_file: str, iters: int, out: dict) -> None:
    torch.set_num_threads(1)
    # FSDP2's own calls (torch 2.13); the older names where they are missing
    all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    x, gathered = torch.ones(NUMEL), torch.empty(2 * NUMEL)
    ops = {
        f"all_gather ({NUMEL} fp32)": lambda: all_gather(gathered, x),
        f"reduce_scatter ({NUMEL} fp32)": lambda: reduce_scatter(x[: NUMEL // 2], x),
        f"all_reduce ({NUMEL} fp32)": lambda: dist.all_reduce(x),
        "barrier": dist.barrier,
    }
    for name, op in ops.items():
        for _ in range(20):  # warm-up
            op()
        rounds = []
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(iters // 5):
                op()
            rounds.append((time.perf_counter() - t) / (iters // 5))
        if rank == 0:
            out[name] = statistics.median(rounds)
    dist.destroy_process_group()


def socket_round_trip(iters: int) -> float:
    """A 1-byte ping-pong over a Unix socket pair between this process and a forked child."""
    a, b = socket.socketpair()
    pid = os.fork()
    if pid == 0:
        for _ in range(iters + 20):
            b.recv(1)
            b.send(b"x")
        os._exit(0)
    for _ in range(20):
        a.send(b"x")
        a.recv(1)
    t = time.perf_counter()
    for _ in range(iters):
        a.send(b"x")
        a.recv(1)
    seconds = (time.perf_counter() - t) / iters
    os.waitpid(pid, 0)
    a.close()
    b.close()
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=500)
    args = parser.parse_args()
    with private_tmp("gloo-floor") as tmp:
        rtt = socket_round_trip(args.iters)
        with mp.Manager() as manager:
            out = manager.dict()
            with rendezvous_file(tmp) as init:
                mp.spawn(_collectives, args=(init, args.iters, out), nprocs=2)
            result = dict(out)
        print(f"{'socket round trip (1 B)':28s} {rtt * 1e6:9.1f} us   1.0x")
        for name, seconds in result.items():
            print(f"{name:28s} {seconds * 1e6:9.1f} us   {seconds / rtt:.1f}x")


if __name__ == "__main__":
    main()
