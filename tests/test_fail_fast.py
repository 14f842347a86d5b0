"""A failing search fails fast (properties/fail_fast.py, issue 38): the first failure is handed
over before Hypothesis shrinks it, a case seen before is not run again, and shrinking stops after
its time budget with the smallest failing case found by then. The search here runs a stand-in
property (no ranks): what is measured is the search's own behaviour, call by call."""

import pytest

from fsdp_verify.properties.fail_fast import FailFast
from fsdp_verify.properties.failure import PropertyFailed
from fsdp_verify.properties.search import search
from fsdp_verify.properties.strategies import cases
from fsdp_verify.sharded.pool import RankFailure
from tests.conftest import mlp_case

STRATEGY = cases(world_sizes=(2, 3), model_kinds=("mlp",), precisions=("fp32", "bf16"))


class CrashesOnBf16:
    """A property as a rank that aborts on bf16 parameters would make it: every call logged."""

    def __init__(self):
        self.calls: list[tuple[str, bool]] = []  # (case hash, failed)

    def __call__(self, case):
        failed = case.precision.param_dtype == "bf16"
        self.calls.append((case.hash, failed))
        if failed:
            crash = RankFailure("crash", 1, "step 1 forward (micro-batch 0)", "process killed by signal 6")
            raise PropertyFailed("sharded-equals-reference", case, failure=crash)
        return None

    def runs_after_the_first_failure(self) -> int:
        first = next(i for i, (_, failed) in enumerate(self.calls) if failed)
        return len(self.calls) - first - 1


def _search(prop, shrink_seconds, said):
    return search(
        prop,
        STRATEGY,
        profile="ci",
        max_examples=30,
        seed=7,
        shrink_seconds=shrink_seconds,
        on_first_failure=lambda failure, seconds: said.append((failure, seconds, len(prop.calls))),
    )


def test_the_first_failure_is_said_before_shrinking_and_no_case_runs_twice():
    prop, said = CrashesOnBf16(), []
    result = _search(prop, None, said)
    assert result.failure is not None and result.failure.case.precision.param_dtype == "bf16"
    ((failure, seconds, calls_then),) = said  # once, the moment the first failing case ran
    assert prop.calls[calls_then - 1] == (failure.case.hash, True) and not any(
        f for _, f in prop.calls[: calls_then - 1]
    )
    assert result.first_failure is failure and result.first_failure_seconds == seconds >= 0
    assert prop.runs_after_the_first_failure() > 0  # without a budget, Hypothesis shrinks (runs cases)
    hashes = [h for h, _ in prop.calls]
    assert len(hashes) == len(set(hashes))  # Hypothesis asked again (the replays): answered from memory
    assert result.shrink_note is None


def test_past_the_shrink_budget_no_case_runs_and_the_smallest_failure_so_far_is_reported():
    prop, said = CrashesOnBf16(), []
    result = _search(prop, 0.0, said)
    assert prop.runs_after_the_first_failure() == 0
    assert result.failure is not None and result.failure.case.hash == said[0][0].case.hash
    assert "shrinking stopped 0 s after the first failure" in result.shrink_note


def test_memory_answers_a_case_seen_before_and_raises_its_failure_again():
    runs = []

    def run(case):
        runs.append(case.hash)
        if case.world_size == 3:
            raise PropertyFailed("p", case)
        return "verdict"

    memory, first = FailFast(None, on_first_failure=lambda f: seen.append(f)), None
    seen = []
    ok, bad = mlp_case(2), mlp_case(3)
    assert memory(ok, run) == "verdict" and memory(ok, run) == "verdict"
    with pytest.raises(PropertyFailed) as a:
        memory(bad, run)
    with pytest.raises(PropertyFailed) as b:
        memory(bad, run)
    assert a.value is b.value is seen[0] and first is None and len(seen) == 1
    assert runs == [ok.hash, bad.hash] and memory.remembered == 2
    # another key (another property or its options on the same case) is another run
    assert memory(ok, run, key=("other", ok.hash)) == "verdict" and len(runs) == 3


def test_the_budget_is_counted_from_the_first_failure():
    now = [100.0]
    memory = FailFast(5.0, clock=lambda: now[0])
    assert not memory.budget_spent
    with pytest.raises(PropertyFailed):
        memory(mlp_case(3), lambda c: (_ for _ in ()).throw(PropertyFailed("p", c)))
    now[0] += 4.9
    assert not memory.budget_spent
    now[0] += 0.2
    assert memory.budget_spent
    # outside a Hypothesis test nothing is rejected: a plain test that calls the property runs it
    assert memory(mlp_case(2), lambda c: "ran") == "ran"
