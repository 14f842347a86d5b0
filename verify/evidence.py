"""What the records show about a divergence, tested before a hint names a cause (verify/hints.py):
a value that is another record's, or its rows in another order, a value at a lower precision's
rounding, the ranks whose
pieces differ, one factor across a step's records. Each answers from the two Traces alone (the
sharded one's `rank_rows` say which rows each rank held); None or empty: the records do not show
it, and the hint describes instead of naming a cause."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fsdp_verify.dims.parallel_dims import ParallelDims
from fsdp_verify.sharded.collect import rank_rows
from fsdp_verify.trace import Key, Trace

# The precisions a value may have been stored in and read back from (a checkpoint's, a cast).
LOWER_PRECISIONS = {torch.bfloat16: "bf16", torch.float16: "fp16"}
# A fitted factor holds when what it leaves is this small a part of the record (as the gradient
# hints always held it): far below any bug's, far above float noise.
FIT = 1e-3


def rounded_through(saved: torch.Tensor, got: torch.Tensor) -> str | None:
    """The lower precision ("bf16", "fp16") whose rounding of `saved` gives `got` exactly, where
    `got` is not `saved` itself; None if none does."""
    if not saved.is_floating_point() or got.dtype != saved.dtype or got.shape != saved.shape:
        return None
    if torch.equal(saved, got):
        return None
    for dtype, name in LOWER_PRECISIONS.items():
        if torch.finfo(dtype).bits < torch.finfo(saved.dtype).bits and torch.equal(
            saved.to(dtype).to(saved.dtype), got
        ):
            return name
    return None


def rows_moved(saved: torch.Tensor, got: torch.Tensor) -> list[int] | None:
    """Where `got` holds `saved`'s rows (its first dim: experts, a shard's rows) exactly but in
    another order, the saved row each loaded row is (`[j for each row i]`); None where any loaded
    row is no saved row, or nothing moved."""
    if got.shape != saved.shape or got.dtype != saved.dtype or got.dim() == 0 or len(got) < 2:
        return None
    unused = list(range(len(saved)))
    order = []
    for row in got:
        j = next((j for j in unused if torch.equal(saved[j], row)), None)
        if j is None:
            return None
        unused.remove(j)
        order.append(j)
    return None if order == sorted(order) else order


def equal_records(value: torch.Tensor, candidates: dict[str, torch.Tensor]) -> list[str]:
    """The names of the candidates that hold exactly `value` (shape, dtype and every bit)."""
    return [
        n for n, t in candidates.items() if t.shape == value.shape and t.dtype == value.dtype and torch.equal(t, value)
    ]


def chunks_rotated(saved: torch.Tensor, got: torch.Tensor, most: int = 8) -> tuple[int, int, int] | None:
    """(dim, n, k) where `got` is `saved` cut into n equal chunks along dim with chunk i holding
    saved chunk (i + k) % n, k in 1..n-1, exactly, for the fewest chunks up to `most`: shards that
    landed on other ranks in a ring (a tp degree's shards by position). None where none is, or
    where `got` is `saved` itself."""
    if got.shape != saved.shape or got.dtype != saved.dtype or torch.equal(saved, got):
        return None
    for n in range(2, most + 1):
        for dim in range(saved.dim()):
            if saved.shape[dim] % n:
                continue
            chunks = saved.chunk(n, dim)
            for k in range(1, n):
                if torch.equal(torch.cat(chunks[k:] + chunks[:k], dim), got):
                    return dim, n, k
    return None


def generators_taken_from(ref: Trace, got: Trace, step: int) -> dict[int, int] | None:
    """Right after a resume's load at `step`: for each rank whose generator (the `resumed rng`
    fingerprints) is not the run that never stopped has there, the rank of the saving run whose
    generator it is (the fingerprint that rank's last backward of the step ended with, its `rng`
    record `after_backward.<last micro-batch>`: nothing draws after it before the save). None
    where the records do not show it: no such records, or a differing rank whose generator is
    no saving rank's (a fresh seed: not restored)."""
    key = (step, "resumed", "rng")
    if key not in ref.records or key not in got.records:
        return None
    expected, loaded = ref.records[key].tolist(), got.records[key].tolist()
    last = sorted((k for k in got.records if k[:2] == (step, "rng") and k[2].startswith("after_backward.")), key=str)
    if len(expected) != len(loaded) or not last:
        return None
    ended = got.records[max(last, key=lambda k: int(k[2].rsplit(".", 1)[1]))].tolist()
    taken = {}
    for rank, (want, have) in enumerate(zip(expected, loaded)):
        if want != have:
            if have not in ended:
                return None
            taken[rank] = ended.index(have)
    return taken or None


def rank_deviations(ref: torch.Tensor, got: torch.Tensor, spans: list[list[int]]) -> dict[int, float]:
    """Per rank holding rows of the record: the largest change of its rows relative to the whole
    reference's largest element (the comparators' normwise measure, restricted to its rows)."""
    a, b = ref.detach().double(), got.detach().double()
    scale = a.abs().max().item() if a.numel() else 0.0
    out: dict[int, float] = {}
    for rank, start, end in spans:
        if end <= start:
            continue
        diff = (a[start:end] - b[start:end]).abs().max().item()
        out[rank] = max(out.get(rank, 0.0), diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf")))
    return out


@dataclass
class RanksApart:
    """Ranks by how their rows of some records compare: bit for bit the reference's, off by more
    than a limit, or in between (within it, not exact)."""

    right: list[int]
    wrong: list[int]
    unsure: list[int]


def ranks_apart(ref: Trace, got: Trace, keys: list[Key], limit: float = 0.0) -> RanksApart | None:
    """The ranks holding rows of the records `keys`, by how those rows compare (a rank is wrong
    if any of its rows is off by more than `limit`, right if all are exact); None where none of
    them was recorded per rank (a view that makes its own full tensors, a replicated value)."""
    devs: dict[int, float] = {}
    for key in keys:
        spans = rank_rows(got, key)
        if spans is None or key not in ref.records or key not in got.records:
            continue
        a, b = ref.records[key], got.records[key]
        if a.shape != b.shape or not a.shape:
            continue
        for rank, dev in rank_deviations(a, b, spans).items():
            devs[rank] = max(devs.get(rank, 0.0), dev)
    if not devs:
        return None
    return RanksApart(
        right=sorted(r for r, d in devs.items() if d == 0),
        wrong=sorted(r for r, d in devs.items() if d > limit),
        unsure=sorted(r for r, d in devs.items() if 0 < d <= limit),
    )


def factor(ref: torch.Tensor, got: torch.Tensor, fit: float | None = None) -> float | None:
    """c with got = c x ref, to `fit` (default `fit_of` the records) of the record's norm; None if
    no single factor fits (or the reference is zero)."""
    a, b = ref.detach().double().flatten(), got.detach().double().flatten()
    if a.shape != b.shape:
        return None
    denom = a.dot(a).item()
    if denom == 0:
        return None
    c = a.dot(b).item() / denom
    fit = fit_of(ref.dtype, got.dtype) if fit is None else fit
    return c if (b - c * a).norm().item() <= fit * a.norm().item() else None


def fit_of(*dtypes: torch.dtype | None) -> float:
    """How closely a factor must fit: `FIT`, or where the arithmetic ran in bf16 or fp16 (the
    records' dtype, or the reduction's: its gradients are recorded in fp32) two of that dtype's
    unit roundoffs, since a gradient scaled there (a `/ 3` in bf16) is rounded again, each element
    off by up to u of itself: `FIT` alone read that as no factor (a sweep's bf16 case at 3 ranks
    split one cause in two, every gradient but one 1/3 of the reference's, the factors 0.3332 to
    0.3336)."""
    u = max((torch.finfo(d).eps / 2 for d in dtypes if d in LOWER_PRECISIONS), default=0.0)
    return max(FIT, 2 * u)


def near(x: float, value: float, fit: float = FIT) -> bool:
    return abs(x - value) <= fit * abs(value)


def step_dp_size(got: Trace, step: int) -> int | None:
    """The data-parallel ranks that ran `step` (a resumed run's may differ from the saving run's):
    the ranks the step's item counts were recorded for (under tp or pp fewer than the world)."""
    items = got.meta.get("items", {}).get(str(step))
    return len(items) if items else None


@dataclass(frozen=True)
class Groups:
    """The groups of ranks that ran a step, by size, from the case's mesh: what a gradient may
    have been divided by (or not) by mistake. `experts`: the grouped experts' module names, whose
    parameters an ep group holds (under ep)."""

    world: int
    dp: int
    tp: int = 1
    pp: int = 1
    ep: int = 1
    experts: tuple[str, ...] = ()
    microbatches: int = 1  # a pipeline's schedule divides by them
    scale_grads: bool = True  # ... where it scales (`pp_scale_grads`; torchtitan's does not)

    def is_expert(self, name: str) -> bool:
        return any(name.startswith(f"{fqn}.") for fqn in self.experts)

    def text(self) -> str:
        """ "the world size 4: data-parallel 2 x tp 2": how the world is made up, outermost first."""
        return f"the world size {self.world}: {self.dims.describe()}"

    @property
    def dims(self) -> ParallelDims:
        return ParallelDims(self.world, (self.dp,), self.pp, self.tp, self.ep)


def step_groups(case, got: Trace, step: int) -> Groups:
    """The groups of the run that took `step` (after a resume, the resumed run's degrees)."""
    if case.resume_after is not None and step > case.resume_after:
        case = case.after_resume()
    experts: tuple[str, ...] = ()
    if case.ep > 1:
        from fsdp_verify.models import module_classes

        experts = tuple(n for n, cls in module_classes(case.model).items() if cls == "GroupedExperts")
    dims = case.parallel
    return Groups(
        dims.world_size, dims.dp_size, dims.tp, dims.pp, dims.ep, experts, case.microbatches, case.pp_scale_grads
    )
