"""PropertyFailed: how a property says a Case broke it, carrying what a person needs to replay it."""

from __future__ import annotations

from pathlib import Path

from fsdp_verify.case import Case
from fsdp_verify.repro.files import replay_command, write_repro
from fsdp_verify.sharded.pool import RankFailure
from fsdp_verify.verdict import PHASE_TITLES, Verdict


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
