"""What the Recorder costs: a 20-step run of the medium built-in Transformer (bench/overhead.py's
MEDIUM model: 4 layers, width 128, vocab 512, sequence 64, batch 8; Adam) with no recorder, with
the recorder's fingerprints only, and with every tensor stored whole at every step, as ratios to
the bare run. Rounds are interleaved (bare, fingerprints, whole, bare, ...) after a warm-up round,
and the median of each is taken, so load from other jobs falls on all three alike.
Target: fingerprints-only / bare < 1.10.

    python bench/recorder_overhead.py [--steps 20] [--repeats 5] [--world-size 1|2] [--json out.json]

--world-size 2 runs the same loop under FSDP2 on two gloo ranks (batch 4 each), the recorder on
every rank; the table is rank 0's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from fsdp_verify.models import ModelSpec, build_model
from fsdp_verify.recorder import Recorder


class TimedRecorder(Recorder):
    """The Recorder, with the time spent inside it (hooks and step) added up: a second measure of
    its cost that does not depend on two runs seeing the same load from other jobs."""

    inside = 0.0

    def _timed(self, fn, *args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TimedRecorder.inside += time.perf_counter() - t

    def before_optimizer_step(self):
        return self._timed(super().before_optimizer_step)

    def _after_optimizer(self, *a):
        return self._timed(super()._after_optimizer, *a)

    def step(self, **kw):
        return self._timed(super().step, **kw)


MEDIUM = dict(vocab_size=512, dim=128, n_layers=4, n_heads=4, ffn_hidden=344, seq_len=64)
MODES = ("bare", "fingerprints", "whole")


def one_run(mode: str, steps: int, batch: int, out: str, world: int) -> tuple[float, float]:
    model = build_model(ModelSpec(kind="transformer", **MEDIUM), seed=0)
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    rec = None
    if mode != "bare":
        rec = TimedRecorder(model, optimizer, out=out, full_steps=range(steps + 1) if mode == "whole" else ())
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, MEDIUM["vocab_size"], (steps, batch, MEDIUM["seq_len"] + 1), generator=g)
    if world > 1:
        dist.barrier()
    TimedRecorder.inside = 0.0
    start = time.perf_counter()
    for step in range(steps):
        inputs, targets = tokens[step, :, :-1], tokens[step, :, 1:]
        logits = model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if rec:
            rec.step(loss=loss, logits=logits, batch=(inputs, targets))
    if world > 1:
        dist.barrier()
    seconds, inside = time.perf_counter() - start, TimedRecorder.inside
    if rec:
        rec.close()
    return seconds, inside


def measure(steps: int, repeats: int, world: int, rank: int = 0) -> dict[str, float]:
    torch.set_num_threads(1)
    times: dict[str, list[float]] = {m: [] for m in MODES}
    inside: dict[str, list[float]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory(prefix="fsdp-verify-rec-") as tmp:
        for i in range(repeats + 1):
            for mode in MODES:
                t, t_in = one_run(mode, steps, 8 // world, os.path.join(tmp, f"{mode}-{i}"), world)
                if i > 0:  # the first round warms up
                    times[mode].append(t)
                    inside[mode].append(t_in)
        sizes = {m: sum(f.stat().st_size for f in Path(tmp).glob(f"{m}-1/rank{rank}/*")) for m in MODES[1:]}
    med = {m: statistics.median(v) for m, v in times.items()}
    # The same rounds, each recorded run's time inside the recorder over the bare run of its round.
    paired = {m: statistics.median(i / b for i, b in zip(inside[m], times["bare"])) for m in MODES[1:]}
    return {
        **{f"{m}_s": med[m] for m in MODES},
        **{f"{m}_ratio": med[m] / med["bare"] for m in MODES[1:]},
        **{f"{m}_inside_ratio": 1 + paired[m] for m in MODES[1:]},
        **{f"{m}_bytes_per_rank": sizes[m] for m in MODES[1:]},
    }


def _rank_main(rank: int, store: str, world: int, steps: int, repeats: int, out: str) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    result = measure(steps, repeats, world, rank)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--world-size", type=int, default=1, choices=[1, 2])
    p.add_argument("--json", type=str)
    args = p.parse_args()
    if args.world_size == 1:
        result = measure(args.steps, args.repeats, 1)
    else:
        tmp = tempfile.mkdtemp(prefix="fsdp-verify-rec-bench-")
        out = os.path.join(tmp, "result.json")
        mp.spawn(_rank_main, args=(os.path.join(tmp, "store"), 2, args.steps, args.repeats, out), nprocs=2)
        with open(out) as f:
            result = json.load(f)
    print(f"medium Transformer {MEDIUM}, {args.steps} steps, world size {args.world_size}, median of {args.repeats}")
    print("ratio: wall time over the bare run's; 1 + inside: 1 + the time spent inside the recorder over the bare run")
    print(f"{'mode':14s} {'seconds':>9s} {'ratio':>7s} {'1+inside':>9s} {'MB/rank':>8s}")
    for m in MODES:
        ratio = 1.0 if m == "bare" else result[f"{m}_ratio"]
        inside = "" if m == "bare" else f"{result[f'{m}_inside_ratio']:9.3f}"
        mb = "" if m == "bare" else f"{result[f'{m}_bytes_per_rank'] / 1e6:8.2f}"
        print(f"{m:14s} {result[f'{m}_s']:9.3f} {ratio:7.3f} {inside:>9s} {mb:>8s}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
