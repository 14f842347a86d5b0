"""Model build check: every rank built the same model as rank 0 (read from the build probe).
A user's factory that initialises without the seed set before it, or sizes a layer by rank,
is named here at step 0, before any comparison of values that could not agree."""

from __future__ import annotations

from fsdp_verify.case import Case
from fsdp_verify.compare.finding import Finding
from fsdp_verify.trace import Trace

COMPARATOR = "ModelBuildCheck"


def who_builds(case: Case) -> str:
    return f"the model factory {case.model.factory}" if case.model.is_custom else "the model"


def check_build(case: Case, ref: Trace, got: Trace) -> list[Finding]:
    per_rank = got.meta.get("build")
    if not per_rank:
        return []
    base = {name: (shape, dtype, h) for name, shape, dtype, h in per_rank[0]}
    for rank, params in enumerate(per_rank[1:], start=1):
        names = [name for name, *_ in params]
        if names != list(base):
            extra = sorted(set(names) ^ set(base))
            first = extra[0] if extra else next(a for a, b in zip(names, base) if a != b)
            return [_fail(case, rank, first, "other parameter names (or another order)")]
        for name, shape, dtype, h in params:
            shape0, dtype0, h0 = base[name]
            if (shape, dtype) != (shape0, dtype0):
                why = f"shape {tuple(shape)} {dtype} vs rank 0's {tuple(shape0)} {dtype0}"
                return [_fail(case, rank, name, why)]
            if h != h0:
                return [_fail(case, rank, name, "other values")]
    return []


def _fail(case: Case, rank: int, name: str, why: str) -> Finding:
    message = (
        f"{who_builds(case)} built different parameters on rank {rank} than on rank 0: first {name!r} ({why});"
        " a factory must build the same model on every rank: draw initial values from the global seed set"
        " before it runs (or an init_fn's generator), never from the rank (dist.get_rank(), or the RANK and"
        " LOCAL_RANK variables a launcher sets)"
    )
    return Finding(0, "build", name, False, "mismatch", COMPARATOR, message)


def build_summary(case: Case, ref: Trace, got: Trace) -> str | None:
    per_rank = got.meta.get("build")
    if not per_rank or not case.model.is_custom:
        return None  # built-in models: silent (the table's build column shows only when there is news)
    return f"every rank built the same {len(per_rank[0])} parameters"
