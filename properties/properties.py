"""Named properties: plain functions of a Case, usable from pytest, the CLI and the nightly job.

A property returns its Verdict when it holds and raises `PropertyFailed` when it does not, so it
works as the body of a Hypothesis test as it is: Hypothesis shrinks the Case that raised, and the
exception of the smallest failing Case is the one reported. A rank that crashes or hangs
(`RankFailure`) is a failure of the property too, reported the same way, not a crash of the runner.
Its PropertyFailed carries no `__context__`: Hypothesis tells bugs apart by where an exception and
its context were raised, and the pool notices a crash at one of several lines (a rank's closed
pipe, or its peer's error first), which made one crash two bugs, each shrunk on its own.
"""

from __future__ import annotations

from collections.abc import Callable

from fsdp_verify.case import Case
from fsdp_verify.properties.failure import PropertyFailed
from fsdp_verify.properties.rerun import rerun_property
from fsdp_verify.runner import check_case
from fsdp_verify.sharded.pool import RankFailure, RankPool, get_pool
from fsdp_verify.verdict import Verdict


def sharded_equals_reference(
    case: Case, *, pool: RankPool | None = None, calibrate: bool = True, timeout_s: float | None = None
) -> Verdict:
    """The sharded engine's run matches the single-device reference on every record, within the
    derived tolerance (verify/compare/tolerance.py)."""
    pool = pool or get_pool(case.world_size)
    try:
        verdict = check_case(case, pool=pool, timeout_s=timeout_s, calibrate=calibrate)
    except RankFailure as e:
        failure = e
    else:
        failure = None
    if failure is not None:  # raised outside the except: no __context__, so one bug to Hypothesis
        raise PropertyFailed("sharded-equals-reference", case, failure=failure)
    if not verdict.ok:
        raise PropertyFailed("sharded-equals-reference", case, verdict)
    return verdict


# name -> property; each takes a Case (and keyword options) and returns a Verdict or raises.
PROPERTIES: dict[str, Callable[..., Verdict]] = {
    "sharded-equals-reference": sharded_equals_reference,
    "rerun-is-bitwise-identical": rerun_property,
}
