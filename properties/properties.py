"""Named properties: plain functions of a Case, usable from pytest, the CLI and the nightly job.

A property returns its Verdict when it holds and raises `PropertyFailed` when it does not, so it
works as the body of a Hypothesis test as it is: Hypothesis shrinks the Case that raised, and the
exception of the smallest failing Case is the one reported. A rank that crashes or hangs
(`RankFailure`) is a failure of the property too, reported the same way, not a crash of the runner.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from properties.rerun import rerun_property
from verify.case import Case
from verify.pool import RankFailure, RankPool, get_pool
from verify.repro import replay_command, write_repro
from verify.verdict import PHASE_TITLES, Verdict


class PropertyFailed(AssertionError):
    """`case` broke property `name`: `verdict` says where (None when a rank crashed or hung, then
    `failure` says which rank and phase). `write_repro(dir)` writes the Case file; from then on
    str() ends with the one command that replays it."""

    def __init__(
        self, name: str, case: Case, verdict: Verdict | None = None, failure: RankFailure | None = None
    ) -> None:
        self.name = name
        self.case = case
        self.verdict = verdict
        self.failure = failure
        self.repro_path: Path | None = None
        super().__init__(name)

    @property
    def first_divergence(self) -> str:
        """One line: where the runs first part, or which rank failed where."""
        if self.failure is not None:
            return f"rank {self.failure.rank} {self.failure.kind} in phase {self.failure.phase!r}"
        first = self.verdict.first_divergence if self.verdict else None
        if first is None:
            return "none"
        return f"step {first.step}, {PHASE_TITLES.get(first.phase, first.phase)}, {first.name!r}"

    def summary(self) -> str:
        if self.failure is not None:
            return f"FAILED: a rank failed on case {self.case.hash}: {self.failure}"
        return self.verdict.summary() if self.verdict else f"FAILED: case {self.case.hash}"

    def write_repro(self, out_dir: str | Path) -> Path:
        self.repro_path = write_repro(self.case, out_dir)
        return self.repro_path

    def __str__(self) -> str:
        lines = [
            f"property {self.name!r} failed",
            self.summary(),
            f"First divergence: {self.first_divergence}",
            f"Case {self.case.hash}: {self.case.to_json()}",
        ]
        if self.repro_path is not None:
            lines.append(f"Replay: {replay_command(self.repro_path)}")
        return "\n".join(lines)


def sharded_equals_reference(
    case: Case, *, pool: RankPool | None = None, calibrate: bool = True, timeout_s: float | None = None
) -> Verdict:
    """The sharded engine's run matches the single-device reference on every record, within the
    derived tolerance (verify/tolerance.py)."""
    from verify.runner import check_case

    pool = pool or get_pool(case.world_size)
    try:
        verdict = check_case(case, pool=pool, timeout_s=timeout_s, calibrate=calibrate)
    except RankFailure as e:
        raise PropertyFailed("sharded-equals-reference", case, failure=e) from None
    if not verdict.ok:
        raise PropertyFailed("sharded-equals-reference", case, verdict)
    return verdict


# name -> property; each takes a Case (and keyword options) and returns a Verdict or raises.
PROPERTIES: dict[str, Callable[..., Verdict]] = {
    "sharded-equals-reference": sharded_equals_reference,
    "rerun-is-bitwise-identical": rerun_property,
}
