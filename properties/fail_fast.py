"""A failing search that fails fast: the first failure is handed over (saved, printed) the moment
it is seen, before Hypothesis shrinks it; a case the search already ran is answered from memory;
and shrinking stops after a time budget.

Why: Hypothesis shrinks a failure by rerunning smaller variants of it, and reruns the failing case
itself before and after shrinking. A case here costs 0.1-2 s, and one that crashes a rank costs
a restart of the pool, so a search on an engine that crashes ranks spent minutes shrinking
through crash after crash before it said anything (issue 38: 8 min 51 s), and a run stopped
meanwhile lost the failure. Past the budget, a case not yet run is rejected (`hypothesis.reject`,
which the shrinker reads as "not a smaller failure"), so Hypothesis ends with the smallest
failing case found by then; it replays that one, which the memory answers without a run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import hypothesis

from fsdp_verify.case import Case
from fsdp_verify.properties.failure import PropertyFailed
from fsdp_verify.verdict import Verdict


class FailFast:
    """One search's memory and clock. `__call__(case, run)` runs `run(case)` unless the case ran
    before (then its verdict, or its PropertyFailed raised again) or the shrink budget is spent."""

    def __init__(
        self,
        shrink_seconds: float | None,
        on_first_failure: Callable[[PropertyFailed], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.shrink_seconds = shrink_seconds  # None: no budget (Hypothesis's own limits)
        self.on_first_failure = on_first_failure
        self.clock = clock
        self.started = clock()
        self.first_failure: PropertyFailed | None = None
        self.first_failure_at: float | None = None  # seconds after the start
        self.runs = 0
        self.remembered = 0  # calls answered from memory
        self.rejected = 0  # cases not run: the budget was spent
        self._seen: dict[Any, Verdict | PropertyFailed] = {}  # by key

    @property
    def budget_spent(self) -> bool:
        if self.first_failure_at is None or self.shrink_seconds is None:
            return False
        return self.clock() - self.started - self.first_failure_at > self.shrink_seconds

    def __call__(self, case: Case, run: Callable[[Case], Verdict], key: Any = None) -> Verdict:
        """`run(case)`, remembered under `key` (default: the case's hash; a value without one, as
        a test's own strategy may draw, is not remembered)."""
        key = getattr(case, "hash", None) if key is None else key
        if key is not None and key in self._seen:  # a property that returns None was seen too
            seen = self._seen[key]
            self.remembered += 1
            if isinstance(seen, PropertyFailed):
                raise seen  # its traceback ends where it was first raised: Hypothesis sees the same bug
            return seen
        if self.budget_spent and hypothesis.currently_in_test_context():
            self.rejected += 1
            hypothesis.reject()
        self.runs += 1
        try:
            verdict = run(case)
        except PropertyFailed as failure:
            if key is not None:
                self._seen[key] = failure
            if self.first_failure is None:
                self.first_failure, self.first_failure_at = failure, self.clock() - self.started
                if self.on_first_failure is not None:
                    self.on_first_failure(failure)
            raise
        if key is not None:
            self._seen[key] = verdict
        return verdict

    def stopped_note(self) -> str | None:
        """A line for the reader when the budget cut shrinking short, else None."""
        if not self.rejected:
            return None
        return (
            f"shrinking stopped {self.shrink_seconds:g} s after the first failure (the shrink budget):"
            " the case reported is the smallest failing one found by then"
        )


def first_failure_file(failure: PropertyFailed, out_dir) -> Any:
    """The first failure's Case, saved as `first-failure-<hash>.json` in `out_dir` (beside the
    shrunk case's `case-<hash>.json`, which it never overwrites)."""
    from pathlib import Path

    return failure.case.save(Path(out_dir) / f"first-failure-{failure.case.hash}.json")
