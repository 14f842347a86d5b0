"""A recorded run read back as global records: each step's loss, logits, batch hashes and each
optimizer step's fingerprints put back together from the ranks' shards (rows at their offsets),
so a reference recorded on one process and a sharded run on W line up record by record."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from fsdp_verify.compare.tolerance import measure
from fsdp_verify.recorder.store import Run


@dataclass
class Rows:
    """One tensor's fingerprint: per row (dim 0) its sum and sum of squares, in float64."""

    sum: torch.Tensor
    sq: torch.Tensor
    row_len: int
    full: torch.Tensor | None = None  # the tensor whole, where it was recorded so
    # Rows that more than one rank holds (a plain tensor, a replicated DTensor): the largest
    # deviation between two ranks' copies, and those two ranks (the first holder, the other).
    spread: tuple[float, int, int] | None = None

    @property
    def norms(self) -> torch.Tensor:
        return self.sq.clamp_min(0).sqrt()

    @property
    def total(self) -> float:
        return float(self.sum.sum())


def row_deviation(ref: Rows, got: Rows) -> float:
    """Normwise: the row norms' largest change relative to the largest row norm, and the row
    sums' relative to the largest value a row's sum can take at that norm (sqrt(row length) x
    norm): both at most the elements' relative change, so one rule fits both."""
    scale = float(ref.norms.max()) if ref.norms.numel() else 0.0
    d_norm = float((ref.norms - got.norms).abs().max()) if ref.norms.numel() else 0.0
    d_sum = float((ref.sum - got.sum).abs().max()) if ref.sum.numel() else 0.0
    if scale == 0:
        return 0.0 if d_norm == d_sum == 0 else math.inf
    return max(d_norm / scale, d_sum / (math.sqrt(ref.row_len) * scale))


def _widen(target: Rows, first: Rows, other: Rows, first_rank: int, rank: int) -> None:
    """Keep in `target.spread` the largest deviation between two ranks' copies of the same rows:
    `first` as its first holder recorded them, `other` as `rank` did."""
    dev = row_deviation(first, other)
    if target.spread is None or dev > target.spread[0]:
        target.spread = (dev, first_rank, rank)


@dataclass
class Step:
    call: int
    opt_steps: list[int]
    opt_before: int  # optimizer steps recorded in earlier calls: 0 means this step's forward saw the initial parameters
    loss: float | None = None
    logits: Rows | None = None
    hashes: list[torch.Tensor] | None = None  # per rank, samples in order
    groups: dict[tuple[int, str], dict[str, Rows]] = field(default_factory=dict)  # (opt step, kind) -> name -> rows
    modules: dict[str, Rows] = field(default_factory=dict)  # Recorder(modules=...): in the order they ran
    # Under a coarse policy, before the first optimizer step: per parameter and row, the norms the
    # backward passes rounded to param_dtype, averaged over the ranks as the gradients are.
    rounding: dict[str, torch.Tensor] = field(default_factory=dict)


def reassemble(tensors: list[dict], headers: list[dict], prefix: str) -> dict[str, Rows]:
    out: dict[str, Rows] = {}
    owner: dict[str, torch.Tensor] = {}  # per row, the first rank that held it (-1: none yet)
    for rank, (t, h) in enumerate(zip(tensors, headers)):
        layout = h.get(prefix)
        if layout is None:
            continue
        sums, squares, start = t[f"{prefix}/row_sum"], t[f"{prefix}/row_sq"], 0
        for name, rows, offset, full_rows, shape, kind in layout:
            numel = 1
            for d in shape:
                numel *= d
            if kind != "rows":  # a total per rank: one row of the whole tensor
                if name not in out:
                    zero = torch.zeros(1, dtype=torch.float64)
                    out[name] = Rows(zero.clone(), zero.clone(), numel)
                    owner[name] = torch.full((1,), -1)
                if kind == "total" or owner[name][0] < 0:  # shards add up; a replica counts once
                    out[name].sum += sums[start]
                    out[name].sq += squares[start]
                    owner[name][0] = rank
                else:
                    other = Rows(sums[start : start + 1], squares[start : start + 1], numel)
                    _widen(out[name], Rows(out[name].sum, out[name].sq, numel), other, int(owner[name][0]), rank)
                start += 1
            else:
                if name not in out:
                    zeros = torch.zeros(full_rows, dtype=torch.float64)
                    out[name] = Rows(zeros.clone(), zeros.clone(), numel // max(full_rows, 1))
                    owner[name] = torch.full((full_rows,), -1)
                sl = slice(offset, offset + rows)
                here_sum, here_sq = sums[start : start + rows], squares[start : start + rows]
                held = owner[name][sl] >= 0  # replicas (plain tensors on every rank): the first rank's rows
                if held.any():
                    row_len = out[name].row_len
                    first = Rows(out[name].sum[sl][held], out[name].sq[sl][held], row_len)
                    other = Rows(here_sum[held], here_sq[held], row_len)
                    _widen(out[name], first, other, int(owner[name][sl][held][0]), rank)
                new = ~held
                out[name].sum[sl][new] = here_sum[new]
                out[name].sq[sl][new] = here_sq[new]
                owner[name][sl][new] = rank
                start += rows
            full = t.get(f"full/{prefix}/{name}")
            if full is not None:
                if out[name].full is None:
                    out[name].full = torch.zeros(shape, dtype=full.dtype)
                out[name].full.reshape(full_rows, -1)[offset : offset + rows] = full.reshape(rows, -1)
    return out


def load_step(run: Run, call: int, opt_before: int) -> Step:
    loaded = [run.load(r, call) for r in range(run.world_at(call))]
    tensors, headers = [t for t, _ in loaded], [h for _, h in loaded]
    step = Step(call=call, opt_steps=list(headers[0].get("opt_steps", [])), opt_before=opt_before)
    if all("loss" in t for t in tensors):
        step.loss = float(torch.stack([t["loss"] for t in tensors]).mean())
    if all("data/hashes" in t for t in tensors):
        step.hashes = [t["data/hashes"] for t in tensors]
    if all("logits/row_sum" in t for t in tensors):
        shape = headers[0]["logits"]
        row_len = 1
        for d in shape[1:]:
            row_len *= d
        step.logits = Rows(
            torch.cat([t["logits/row_sum"] for t in tensors]), torch.cat([t["logits/row_sq"] for t in tensors]), row_len
        )
    for name, shape in headers[0].get("modules", []):
        if all(f"module/{name}/row_sum" in t for t in tensors):
            row_len = 1
            for d in shape[1:]:
                row_len *= d
            step.modules[name] = Rows(
                torch.cat([t[f"module/{name}/row_sum"] for t in tensors]),
                torch.cat([t[f"module/{name}/row_sq"] for t in tensors]),
                row_len,
            )
    if all("rounding/row_norm" in t for t in tensors):
        for t, h in zip(tensors, headers):
            for name, part in zip(
                [n for n, _ in h["rounding"]], t["rounding/row_norm"].split([r for _, r in h["rounding"]])
            ):
                step.rounding[name] = step.rounding.get(name, 0) + part / len(tensors)
    for k in step.opt_steps:
        kinds = sorted({key.split("/", 1)[1] for h in headers for key in h if key.startswith(f"opt{k}/")})
        for kind in kinds:
            step.groups[(k, kind)] = reassemble(tensors, headers, f"opt{k}/{kind}")
    return step


def steps(run: Run):
    """The run's steps in order, loaded one at a time (a long run need not fit in memory)."""
    before = 0
    for call in run.calls[0]:
        step = load_step(run, call, before)
        yield step
        before += len([k for k in step.opt_steps if k > 0])


def deviation(ref, got) -> float:
    """Normwise: the largest change relative to the largest magnitude; for row fingerprints
    `row_deviation`."""
    if isinstance(ref, float):
        if ref == got:
            return 0.0
        return abs(ref - got) / abs(ref) if ref else math.inf
    if isinstance(ref, torch.Tensor):
        return measure(ref, got).normwise
    return row_deviation(ref, got)
