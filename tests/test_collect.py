"""The sharded side's records are kept as pieces on each rank and put together once per case
(verify/sharded/collect.py). These run real gloo ranks, with DTensors laid out as FSDP2 lays them
out, and hold the assembled records to what the collectives give: `full_tensor()` bit for bit,
rows in rank order, the loss summed as gloo sums it, the shard sums of rank 0's group."""

from __future__ import annotations

import os
import resource
import signal
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from fsdp_verify.sharded import collect
from fsdp_verify.sharded.arena import release_arenas
from fsdp_verify.sharded.collect import Collector
from fsdp_verify.sharded.worker import exit_now, leave_process_group
from fsdp_verify.trace import Trace
from tests.ranks import on_threads, spawn

# Rows that do not split evenly: 7 over 3 ranks is 3, 3, 1; 2 over 3 leaves rank 2 empty.
SHAPES = {"even": (6, 4), "uneven": (7, 3), "empty_on_last": (2, 5), "vector": (5,)}


def _values(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {n: torch.randn(s, generator=g, dtype=torch.float32) for n, s in SHAPES.items()}


def _collect(rank: int, world: int, mesh_shape: tuple[int, ...], spill_dir: str | None = None) -> dict | None:
    """Record on this rank as the sharded loop does; rank 0 returns its records and what the
    collectives give for them."""
    if mesh_shape == (-3,):  # ranks 1, 0, 2: rank 0 is not first in its group, records go whole
        mesh_shape = (3,)
        mesh = DeviceMesh("cpu", torch.tensor([1, 0, 2]))
    else:
        mesh = init_device_mesh("cpu", mesh_shape)
    placements = [Shard(0)] if len(mesh_shape) == 1 else [Replicate(), Shard(0)]
    trace = Trace("sharded") if rank == 0 else None
    records = Collector(trace, rank, world, spill_dir=spill_dir)
    expected: dict = {}
    for step in (0, 1):
        named = {n: distribute_tensor(v, mesh, placements) for n, v in _values(step).items()}
        records.tensors(step, "params", named, sums="param_sums")
        records.total(step, "param_sums", "__total__", of=list(named))
        records.rows(step, "logits", "logits", torch.full((2, 3), float(rank + step)))
        records.mean(step, "loss", "loss", torch.tensor(0.1 * (rank + 1) + step))
        # what the collectives give, for comparison (every rank calls them)
        for n, t in named.items():
            expected[(step, "params", n)] = t.full_tensor()
        replicated = distribute_tensor(torch.arange(3.0), mesh, [Replicate()] * len(mesh_shape))
        records.tensors(step, "optim_state", {"replicated": replicated})
        expected[(step, "optim_state", "replicated")] = torch.arange(3.0)
    extras = records.finish({"rank": rank})
    if rank != 0:
        assert extras is None
        return None
    assert extras == [{"rank": r} for r in range(world)]
    return {"records": trace.records, "expected": expected, "rank_rows": trace.meta.get(collect.RANK_ROWS, {})}


def _rank_main(rank: int, world: int, init: str, mesh_shape: tuple[int, ...], out: str, how: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    spill_dir = os.path.dirname(out) if how != "gloo" else None
    # These pieces are small: every one to the arena, or (filling up) the first 256 bytes kept
    # in memory, then all of them moved to the arena, which fills up.
    collect.SPILL_FROM_BYTES = {"arena": 0, "arena-full": 256}.get(how, collect.SPILL_FROM_BYTES)
    if how == "arena-full" and rank > 0:
        # The memory directory fills up mid-case: a write past 1 KB fails (EFBIG, the signal
        # ignored as a full tmpfs gives ENOSPC); what was written comes back, the rest goes by gloo.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    got = _collect(rank, world, mesh_shape, spill_dir)
    if how == "arena":  # a second case through the same arenas: rewritten, read again
        again = _collect(rank, world, mesh_shape, spill_dir)
        if got is not None:
            assert again is not None and all(torch.equal(again["records"][k], v) for k, v in got["records"].items())
    if got is not None:
        got["arenas"] = sorted(n for n in os.listdir(spill_dir) if n.startswith("arena-")) if spill_dir else []
        torch.save(got, out)
    dist.barrier()  # rank 0 has listed the arenas
    release_arenas()
    # As a pool worker leaves: groups freed while the interpreter is alive, then no finalisation
    # (gloo's threads racing C++ static destructors abort a rank at exit under load).
    leave_process_group()
    exit_now(0)


def _threads(world: int, mesh_shape: tuple[int, ...]) -> dict:
    """The same on PyTorch's threaded process group (ranks are threads; it has no send/recv, so
    the pieces go by one gather: the path bench/pool_vs_cold.py's comparison takes)."""

    def collect(rank: int) -> dict | None:
        assert dist.get_backend() == "threaded"
        return _collect(rank, world, mesh_shape)

    return on_threads(world, collect)[0]


def _run(mesh_shape: tuple[int, ...], how: str) -> dict:
    world = 1
    for n in mesh_shape:
        world *= abs(n)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.pt")
        spawn(_rank_main, args=(world, os.path.join(tmp, "init"), mesh_shape, out, how), nprocs=world)
        got = torch.load(out)
        got["left"] = sorted(n for n in os.listdir(tmp) if n.startswith("arena-"))
        return got


def _assert_rank_rows(rank_rows: dict, step: int, mesh_shape: tuple[int, ...], world: int) -> None:
    """Where each rank's rows sit (for the hints, verify/evidence.py): the logits' rows in rank
    order; a shard's rows in the order of rank 0's shard group, FSDP2's Shard(0) chunks (7 rows
    over 3 ranks: 3, 3, 1; 2 rows: 1, 1, 0); none for a record gathered whole."""
    assert rank_rows[f"{step}/logits/logits"] == [[r, 2 * r, 2 * r + 2] for r in range(world)]
    group = [0, 1] if mesh_shape == (2, 2) else [0, 1, 2]
    for name, full in _values(step).items():
        spans = rank_rows.get(f"{step}/params/{name}")
        if mesh_shape == (-3,):
            assert spans is None, spans
            continue
        sizes = [len(c) for c in full.chunk(len(group))]
        sizes += [0] * (len(group) - len(sizes))
        starts = [sum(sizes[:i]) for i in range(len(group))]
        assert spans == [[r, a, a + n] for r, a, n in zip(group, starts, sizes)], (name, spans)


@pytest.mark.parametrize(
    ("mesh_shape", "ranks"),
    [
        ((3,), "gloo"),
        ((2, 2), "gloo"),
        ((-3,), "gloo"),
        ((3,), "threads"),
        ((3,), "arena"),
        ((2, 2), "arena"),
        ((3,), "arena-full"),
    ],
    ids=[
        "fsdp-3-ranks",
        "hsdp-2x2",
        "rank-0-second",
        "threaded-3-ranks",
        "fsdp-3-ranks-arenas",
        "hsdp-2x2-arenas",
        "arenas-fill-up",
    ],
)
def test_assembled_records_are_what_the_collectives_give(mesh_shape, ranks):
    """Through the process group, or through each rank's arena (verify/sharded/arena.py: a file in
    a directory the ranks share, read by rank 0; twice in a row; and filling up mid-case)."""
    got = _threads(3, mesh_shape) if ranks == "threads" else _run(mesh_shape, ranks)
    world = 1
    for n in mesh_shape:
        world *= abs(n)
    if ranks == "arena":  # ranks 1.. made one each (rank 0 reads), and removed them at the end
        assert len(got["arenas"]) == world - 1 and not got["left"]
    if ranks == "arena-full":  # given up at the first write past the limit
        assert not got["left"]
    records, expected = got["records"], got["expected"]
    shard_group = abs(mesh_shape[-1])  # the size of rank 0's group along the shard dim
    for key, want in expected.items():
        assert torch.equal(records[key], want), key  # bit for bit
    for step in (0, 1):
        values = _values(step)
        for name, full in values.items():
            # rank 0's group's local row chunks, summed in float64, in group order; a record
            # gathered whole (rank 0 not first in its group) is summed whole
            want = torch.zeros((), dtype=torch.float64)
            for chunk in full.chunk(shard_group, dim=0) if mesh_shape != (-3,) else [full]:
                want = want + chunk.double().sum()
            assert torch.equal(records[(step, "param_sums", name)], want), (step, name)
        total = torch.stack([records[(step, "param_sums", n)] for n in values]).sum()
        assert torch.equal(records[(step, "param_sums", "__total__")], total)
        _assert_rank_rows(got["rank_rows"], step, mesh_shape, world)
        rows = torch.cat([torch.full((2, 3), float(r + step)) for r in range(world)])
        assert torch.equal(records[(step, "logits", "logits")], rows)
        losses = [torch.tensor(0.1 * (r + 1) + step) for r in range(world)]
        summed = losses[-1]
        for v in losses[-2::-1]:  # gloo adds one element from the last rank down
            summed = summed + v
        assert torch.equal(records[(step, "loss", "loss")], summed / world)
