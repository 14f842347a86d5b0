"""The sharded side's records, kept by the rank that makes them and put together once per case.

A record used to be a collective: each step all-gathered the logits, all-reduced the loss and
gathered full gradients, parameters and optimizer state. On gloo a collective is a round trip of
0.2 to 2 ms between processes (bench/gloo_floor.py), more than a tiny case's arithmetic. Now each
rank keeps its own piece of a record: its rows of the logits, its loss, its local `Shard(0)` rows
of a DTensor and their float64 sum; rank 0 writes its own DTensor rows straight into the full
tensors. The pieces travel once, at the end of the case: each other rank's through its arena, a
file rank 0 reads, where the ranks share a host and a directory (a pool's, on /dev/shm;
verify/sharded/arena.py), else as one packed byte buffer through the process group; their
headers and the probes' payloads, pickled, in front of that buffer (one all-gather of sizes,
then one send a rank). Rank 0 then puts every record together: rows in rank order, DTensor rows
in the order of rank 0's shard group (the layout `full_tensor()` gives), shard sums in that
order, and the loss summed as gloo sums one element (last rank first, `gloo_scalar_sum`, which
the reference's loss uses too). The bits are the ones the collectives gave.

What a piece cannot say is recorded whole at once, as before: a DTensor in another layout (one
`full_tensor()`, a collective), or the full tensors of an engine view that makes its own
(verify/engines/view.py; FSDP1 and the flat engine do).
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from fsdp_verify.engines.arithmetic import gloo_scalar_sum
from fsdp_verify.sharded.arena import Arena, Fill, arena, read_fill
from fsdp_verify.sharded.gather import all_gather_ints, full_quietly, shard_dim
from fsdp_verify.trace import Key, Trace

ROWS, MEAN, SHARD, SUM = "rows", "mean", "shard", "sum"
# trace.meta[RANK_ROWS]["<step>/<phase>/<name>"]: each rank's rows of a record (`rank_rows`).
RANK_ROWS = "rank_rows"
# A rank's pieces go to its arena once they pass this size (verify/sharded/arena.py); below it
# a file's open, reads and the barrier after them cost more than gloo's send (a tiny case: 9.5 ms
# against 7.4 ms for the whole exchange).
SPILL_FROM_BYTES = 1 << 20


class Collector:
    """Every rank records into one; `finish` (a collective) hands rank 0 the whole trace."""

    def __init__(
        self,
        trace: Trace | None,
        rank: int,
        world_size: int,
        device: torch.device | None = None,
        spill_dir: str | None = None,
        row_ranks: Sequence[int] | None = None,
    ):
        self.trace, self.rank, self.world_size = trace, rank, world_size
        # The ranks that record rows and means (rank 0 among them); None: every rank. One a
        # data-parallel rank: under pipeline parallelism of the first stage, to which the last
        # stage hands its outputs; under tp the first of a tp group, whose ranks hold the same.
        self.row_ranks = frozenset(row_ranks if row_ranks is not None else range(world_size))
        self.device = device or torch.device("cpu")  # where the backend takes tensors (NCCL: the rank's GPU)
        self.pieces: dict[Key, tuple[str, int, torch.Tensor]] = {}  # key -> (kind, position, piece)
        # Given a directory every rank reaches on one host (the pool's, on /dev/shm where there
        # is one), ranks 1.. write their pieces into their arena there as they come (one copy,
        # not a clone and then a send) and rank 0 reads it; else they travel through the group.
        # A tiny case's pieces (kilobytes) stay in memory: a file costs more than gloo there.
        self.spill_dir = spill_dir if rank != 0 else None
        self.kept_bytes = 0
        self.spilled: Arena | None = None
        self.spilled_kinds: dict[str, list[Any]] = {}
        self.in_place: dict[Key, int] = {}  # rank 0: SHARD records begun in the trace, rows filled
        self.totals: list[tuple[Key, list[str]]] = []
        self._groups: dict[tuple[DeviceMesh, int], int | None] = {}

    # ---- recording ----------------------------------------------------------------------------

    def records_rows(self, rank: int) -> bool:
        """Whether `rank` records rows and means (`row_ranks`)."""
        return rank in self.row_ranks

    def full(self, step: int, phase: str, name: str, value: torch.Tensor) -> None:
        """A value every rank holds whole (or only rank 0's counts): rank 0 keeps it now."""
        if self.trace is not None:
            self.trace.add(step, phase, name, value)

    def meta(self, key: str, value: Any) -> None:
        """A fact about the run every rank knows alike (JSON): rank 0 keeps it in the trace's meta."""
        if self.trace is not None:
            self.trace.meta[key] = value

    def rows(self, step: int, phase: str, name: str, local: torch.Tensor) -> None:
        """This rank's rows of a tensor whose rows are the ranks' in rank order (logits)."""
        if self.records_rows(self.rank):
            self._keep((step, phase, name), ROWS, self.rank, local)

    def mean(self, step: int, phase: str, name: str, local: torch.Tensor) -> None:
        """This rank's value of a scalar averaged over ranks (the loss)."""
        if self.records_rows(self.rank):
            self._keep((step, phase, name), MEAN, self.rank, local)

    def tensors(self, step: int, phase: str, named: dict[str, torch.Tensor], sums: str | None = None) -> None:
        """Full values of `named` (DTensors or plain tensors every rank holds whole); with `sums`,
        also each one's float64 sum from the local shards, added over the shard group, under that
        phase: a second path that sees padding leaking into a shard or a row held twice."""
        for name, t in named.items():
            key = (step, phase, name)
            if not isinstance(t, DTensor):
                self.full(*key, t)
                if sums:
                    self.full(step, sums, name, t.detach().double().sum())
                continue
            # The local shard as a plain tensor: `_local_tensor`, not `detach()` or `to_local()`,
            # which go through DTensor's dispatch and autograd (a third of a tiny case's recording).
            local = t._local_tensor.detach()
            dim = shard_dim(t)
            position = self._position(t.device_mesh, dim) if dim is not None and dim >= 0 else None
            if dim == -1:
                self.full(*key, local)
                if sums:
                    self.full(step, sums, name, local.double().sum())
            elif position is None:  # another layout, or rank 0 outside the mesh: whole, now
                whole = full_quietly(t.detach())
                self.full(*key, whole)
                if sums:
                    self.full(step, sums, name, whole.double().sum())
            elif position >= 0:  # a rank of rank 0's shard group; other replicas send nothing
                self._keep(key, SHARD, position, local, global_rows=t.shape[0])
                if sums:
                    self._keep((step, sums, name), SUM, position, local.double().sum())

    def total(self, step: int, phase: str, name: str, of: list[str]) -> None:
        """Record `name` as the sum of the step's records `of` in `phase`, in that order, once
        they are whole."""
        self.totals.append(((step, phase, name), of))

    def _keep(self, key: Key, kind: str, position: int, local: torch.Tensor, global_rows: int = -1) -> None:
        if kind == SHARD and self.trace is not None:
            # Rank 0 heads its group: its rows go straight into the full tensor, the other
            # ranks' rows are copied in after them when they arrive (no piece, no packing).
            full = torch.empty((global_rows, *local.shape[1:]), dtype=local.dtype)
            full[: local.shape[0]].copy_(local.detach())
            self.trace.records[key] = full
            self.in_place[key] = local.shape[0]
            return
        if self.spilled is None and self.spill_dir is not None and self.kept_bytes >= SPILL_FROM_BYTES:
            self._spill()
        if self.spilled is not None:
            try:
                self.spilled.add(key, local)
                self.spilled_kinds[_name(key)] = [kind, position]
                return
            except OSError:  # a full /dev/shm: what was written comes back, the rest stays here
                self._unspill()
        piece = local.detach().clone().contiguous() if local.device.type == "cpu" else local.detach().cpu().contiguous()
        self.pieces[key] = (kind, position, piece)
        self.kept_bytes += piece.numel() * piece.element_size()

    def _spill(self) -> None:
        """From now on this rank's pieces go to its arena, those kept so far first."""
        assert self.spill_dir is not None
        self.spilled, kept = arena(self.spill_dir, f"pieces-{self.rank}").begin(), self.pieces
        self.pieces = {}
        try:
            for key, (kind, position, piece) in kept.items():
                self.spilled.add(key, piece)
                self.spilled_kinds[_name(key)] = [kind, position]
        except OSError:
            self.spilled, self.spilled_kinds, self.pieces = None, {}, kept
        self.spill_dir = None  # one try a case

    def _unspill(self) -> None:
        assert self.spilled is not None
        for key, piece in read_fill(self.spilled.header("pieces", {})).records.items():
            kind, position = self.spilled_kinds[_name(key)]
            self.pieces[key] = (kind, position, piece)
        self.spilled, self.spilled_kinds = None, {}

    def _position(self, mesh: DeviceMesh, dim: int) -> int | None:
        """This rank's place in rank 0's group along mesh dim `dim`; -1 outside it; None when rank
        0 is not in the mesh or not first in its group (records are then gathered whole)."""
        if (mesh, dim) not in self._groups:
            grid = mesh.mesh
            where = (grid == 0).nonzero()
            position = None
            if len(where):
                index: list[Any] = where[0].tolist()
                index[dim] = slice(None)
                group = grid[tuple(index)].tolist()
                if group[0] == 0:
                    position = group.index(self.rank) if self.rank in group else -1
            self._groups[(mesh, dim)] = position
        return self._groups[(mesh, dim)]

    # ---- the one gather -----------------------------------------------------------------------
    def finish(self, extra: Any = None) -> list[Any] | None:
        """Send every rank's pieces and `extra` to rank 0 (collectives); rank 0 puts the records
        together into its trace and gets every rank's `extra` in rank order. Each other rank's
        pieces go in its arena in `spill_dir` (verify/sharded/arena.py), which rank 0 reads, else
        packed into one byte buffer (pickling a medium model's pieces cost 4x the sending); its
        header and `extra`, pickled (small), travel in front of that buffer. One all-gather of
        sizes, then one send a rank: an object all-gather of the headers before the sends took one
        all-gather more and pickling (each a gloo round trip, bench/gloo_floor.py)."""
        header, buf = (None, None) if self.rank == 0 else self._sent()  # rank 0's stay as they are
        if self.world_size == 1 or not dist.is_initialized():
            self._assemble([])
            return [extra]
        said = b"" if self.rank == 0 else pickle.dumps((header, extra), protocol=pickle.HIGHEST_PROTOCOL)
        packed = 0 if buf is None else buf.numel()
        in_arena = int(header is not None and "path" in header)
        sizes = all_gather_ints([len(said), packed, in_arena], self.device)  # every rank learns them
        blob = None
        if self.rank != 0:
            blob = torch.empty(len(said) + packed, dtype=torch.uint8)
            blob[: len(said)] = torch.frombuffer(bytearray(said), dtype=torch.uint8)
            if packed:
                blob[len(said) :] = buf
        bufs = self._to_rank_0(blob, [n + m for n, m, _ in sizes[1:]])
        per_rank: list[Any] = [extra]
        if self.rank == 0:
            others = []
            for (n, _, _), b in zip(sizes[1:], bufs):
                their_header, their_extra = pickle.loads(b[:n].numpy().tobytes())
                per_rank.append(their_extra)
                others.append(Fill(their_header, None if "path" in their_header else b[n:]))
            try:
                self._assemble(others)
            finally:
                for fill in others:
                    fill.close()
        if any(flag for _, _, flag in sizes[1:]):
            dist.barrier()  # rank 0 has read every arena: the next case may write them again
        return per_rank if self.rank == 0 else None

    def _sent(self) -> tuple[dict, torch.Tensor | None]:
        """This rank's pieces: the file they were written to (the header names it, nothing to
        send), or packed into one buffer to send."""
        if self.spilled is not None:
            return self.spilled.header("pieces", {"kinds": self.spilled_kinds}), None
        carrier = Trace("pieces")
        kinds = {}
        for (step, phase, name), (kind, position, piece) in self.pieces.items():
            carrier.records[(step, phase, name)] = piece
            kinds[f"{step}/{phase}/{name}"] = [kind, position]
        carrier.meta["kinds"] = kinds
        return carrier.pack()

    def _to_rank_0(self, buf: torch.Tensor | None, sizes: list[int]) -> list[torch.Tensor]:
        """Ranks 1.. send `buf` (`sizes` bytes each); rank 0 gets them, in rank order. Send/recv
        into buffers of the right size where the backend has them (gloo: half the time of a
        gather of 15 MB, which pads every buffer to the largest); one gather where it has not
        (PyTorch's threaded process group, which bench/pool_vs_cold.py compares against)."""
        got = [torch.empty(n, dtype=torch.uint8, device=self.device) for n in sizes] if self.rank == 0 else []
        if dist.get_backend() != "threaded":
            if self.rank != 0 and sizes[self.rank - 1]:
                dist.send(buf.to(self.device), dst=0)
            for r, b in enumerate(got, 1):
                if b.numel():
                    dist.recv(b, src=r)
            return [b.cpu() for b in got]
        size = max(sizes)
        if size:
            mine = torch.empty(size, dtype=torch.uint8, device=self.device)  # rank 0's: a placeholder
            if buf is not None and buf.numel():
                mine[: buf.numel()] = buf.to(self.device)
            padded = [mine] + [torch.empty_like(mine) for _ in sizes] if self.rank == 0 else None
            dist.gather(mine, padded, dst=0)
            got = [p[:n] for p, n in zip(padded[1:], sizes)] if padded else []
        return [b.cpu() for b in got]

    def _assemble(self, others: list[Fill]) -> None:
        """Rank 0's records whole, from its own pieces and `others` (ranks 1.. in order). Where
        each rank's rows sit in a record put together from rows or shards goes into the trace's
        meta (`RANK_ROWS`): what a hint needs to say which ranks' pieces differ."""
        assert self.trace is not None
        where = self.trace.meta.setdefault(RANK_ROWS, {})
        # One list for each distinct layout (most records share a few): the trace's meta travels
        # pickled to the pool, which writes a shared list once (0.1 ms, not 1.2, for 300 records).
        layouts: dict[tuple, list[list[int]]] = {}

        def put(key: Key, counts: list[tuple[int, int]]) -> None:
            spans = _spans(counts)
            where[_name(key)] = layouts.setdefault(tuple(map(tuple, spans)), spans)

        for key, (kind, _, mine) in self.pieces.items():  # rank 0 holds a piece of every record
            if kind in (ROWS, MEAN):
                # Under tp a rank's rows are its tp group's (the tp ranks hold the same batch):
                # the first rank of each group keeps them (`records_rows`).
                held = [(0, mine)] + [
                    (r, _holding(fill, key, r).read(key)) for r, fill in enumerate(others, 1) if self.records_rows(r)
                ]
                values = [v for _, v in held]
                if kind == ROWS:
                    put(key, [(r, len(v)) for r, v in held])
            else:  # SUM: the ranks of rank 0's group, by position
                values = [mine] + [fill.read(key) for _, fill in _placed(others, key)]
            self.trace.records[key] = _whole(kind, values)
        for key, filled in self.in_place.items():
            full = self.trace.records[key]
            fills = _placed(others, key)
            rows = filled + sum(fill.shape(key)[0] for _, fill in fills)
            if rows != full.shape[0]:
                raise RuntimeError(f"record {_name(key)}: the shards hold {rows} rows, the tensor has {full.shape[0]}")
            counts = [(0, filled)]
            for r, fill in fills:  # each rank's rows straight into place
                n = fill.shape(key)[0]
                fill.read_into(key, full[filled : filled + n])
                filled += n
                counts.append((r, n))
            put(key, counts)
        for (step, phase, name), of in self.totals:
            parts = [self.trace.records[(step, phase, n)] for n in of]
            total = torch.stack(parts).sum() if parts else torch.zeros((), dtype=torch.float64)
            self.trace.add(step, phase, name, total)


def _whole(kind: str, values: list[torch.Tensor]) -> torch.Tensor:
    if kind == ROWS:
        return torch.cat(values)
    if kind == MEAN:  # as gloo's all-reduce adds one element, as the reference adds the loss
        return gloo_scalar_sum(values) / len(values)
    total = values[0].clone()  # SUM, in the group's order
    for v in values[1:]:
        total += v
    return total


def _placed(others: list[Fill], key: Key) -> list[tuple[int, Fill]]:
    """(rank, fill) of those of ranks 1.. that hold a piece of `key`, by their position in rank
    0's group."""
    placed = []
    for r, fill in enumerate(others, 1):
        found = fill.meta["kinds"].get(_name(key))
        if found is not None:
            placed.append((found[1], r, _holding(fill, key, r)))
    return [(r, fill) for _, r, fill in sorted(placed, key=lambda p: p[0])]


def _spans(counts: list[tuple[int, int]]) -> list[list[int]]:
    """[[rank, first row, end row], ...] from (rank, rows) in the order the rows were put."""
    out, start = [], 0
    for rank, n in counts:
        out.append([rank, start, start + n])
        start += n
    return out


def rank_rows(trace: Trace, key: Key) -> list[list[int]] | None:
    """Which rows of the record `key` each rank held ([[rank, first row, end row], ...] in row
    order), where the trace was put together from the ranks' rows or shards; None where it was
    recorded whole (another layout, an engine view that makes its own full tensors) or is the
    reference's."""
    return trace.meta.get(RANK_ROWS, {}).get(_name(key))


def _name(key: Key) -> str:
    return "/".join(map(str, key))


def _holding(fill: Fill, key: Key, rank: int) -> Fill:
    if key not in fill:
        raise RuntimeError(f"record {_name(key)}: rank {rank} recorded no piece of it")
    return fill
