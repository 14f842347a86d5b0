"""Running a property over generated Cases outside pytest (the `fuzz` command, the nightly job,
the toolkit's own tests), and the Hypothesis profiles every entry point shares.

Hypothesis does the search and the shrinking: the property raises `PropertyFailed`, Hypothesis
shrinks the Case and finally replays the smallest failing one, whose exception `search` returns.
The first failure is handed to the caller before shrinking, and shrinking is bounded by time
(fail_fast.py).

Every search runs under a seed, drawn when none is given and returned with the result, so that the
run that found a bug can be repeated whole (not only its shrunk case): `search(..., seed=S)` draws
the same cases again. Ctrl-C ends the search with `SearchInterrupted`, which carries the examples
run so far.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import hypothesis
from hypothesis import given, settings
from hypothesis.strategies import SearchStrategy

from fsdp_verify.case import Case
from fsdp_verify.properties.draw import _no_local_constants
from fsdp_verify.properties.fail_fast import FailFast
from fsdp_verify.properties.failure import PropertyFailed
from fsdp_verify.properties.profiles import default_profile, register_profiles
from fsdp_verify.properties.profiles import shrink_seconds as profile_shrink_seconds
from fsdp_verify.verdict import Verdict

register_profiles()


@dataclass
class Example:
    """One case the search ran: its verdict (None if a rank failed) and wall time."""

    case: Case
    ok: bool
    seconds: float
    verdict: Verdict | None = None
    failure: PropertyFailed | None = None


@dataclass
class SearchResult:
    examples: list[Example] = field(default_factory=list)
    failure: PropertyFailed | None = None  # the shrunk failure, if any
    seconds: float = 0.0
    seed: int | None = None  # the seed the cases were drawn with: pass it back to draw them again
    interrupted: bool = False  # Ctrl-C: `examples` are those that finished before it
    first_failure: PropertyFailed | None = None  # as first seen, before shrinking
    first_failure_seconds: float | None = None  # when, after the search began
    shrink_note: str | None = None  # set when the shrink budget cut shrinking short

    @property
    def ok(self) -> bool:
        return self.failure is None


def search(
    prop: Callable[[Case], Verdict],
    strategy: SearchStrategy[Case],
    *,
    profile: str | None = None,
    max_examples: int | None = None,
    seed: int | None = None,
    replay: bool | None = None,
    on_example: Callable[[Example], None] | None = None,
    on_first_failure: Callable[[PropertyFailed, float], None] | None = None,
    shrink_seconds: float | None = None,
) -> SearchResult:
    """Run `prop` on cases drawn from `strategy` until one fails (then shrink it) or
    `max_examples` pass. Returns every example run (shrinking included), the shrunk failure and the
    seed. `seed`: None draws one (`fresh_seed`). `replay` (default: a seed was given) repeats a run:
    the example database is neither read nor written, so the cases are the seed's alone, not the
    failures an earlier run remembered. `on_first_failure(failure, seconds)` is called the moment
    the first failure is seen, before shrinking; shrinking stops `shrink_seconds` after it
    (default: the profile's, `profiles.shrink_seconds`; fail_fast.py). A case seen before is not
    run again. Ctrl-C raises SearchInterrupted, carrying what ran."""
    name = profile or default_profile()
    base = settings.get_profile(name)
    if replay is None:
        replay = seed is not None
    if seed is None:
        seed = fresh_seed(name)
    overrides = {"max_examples": max_examples} if max_examples is not None else {}
    overrides["derandomize"] = False  # the seed decides, under every profile
    if replay:
        overrides["database"] = None
    result = SearchResult(seed=seed)

    def first_failure(failure: PropertyFailed) -> None:
        result.first_failure, result.first_failure_seconds = failure, memory.first_failure_at
        if on_first_failure is not None:
            on_first_failure(failure, memory.first_failure_at)

    memory = FailFast(shrink_seconds if shrink_seconds is not None else profile_shrink_seconds(name), first_failure)

    def run(case: Case) -> Verdict:
        t0 = time.perf_counter()
        try:
            verdict = prop(case)
        except PropertyFailed as e:
            _record(Example(case, False, time.perf_counter() - t0, e.verdict, e))
            raise
        _record(Example(case, True, time.perf_counter() - t0, verdict))
        return verdict

    def body(case: Case) -> None:
        memory(case, run)

    def _record(example: Example) -> None:
        result.examples.append(example)
        if on_example is not None:
            on_example(example)

    test = hypothesis.seed(seed)(settings(base, **overrides)(given(strategy)(body)))
    t0 = time.perf_counter()
    try:
        with _no_local_constants():  # else the cases of a seed depend on the modules imported so far
            test()
    except KeyboardInterrupt as e:
        result.interrupted, result.seconds = True, time.perf_counter() - t0
        result.shrink_note = memory.stopped_note()
        raise SearchInterrupted(result) from e
    except PropertyFailed as e:
        result.failure = e
    except Exception as e:  # an ExceptionGroup of several distinct failures: report the first
        failures = property_failures(e)
        if not failures:
            raise
        result.failure = failures[0]
    result.seconds = time.perf_counter() - t0
    result.shrink_note = memory.stopped_note()
    return result


class SearchInterrupted(KeyboardInterrupt):
    """Ctrl-C during a search. Still a KeyboardInterrupt (pytest, a caller's loop stop as before);
    `result` holds the examples that finished before it, for the report of what ran."""

    def __init__(self, result: SearchResult):
        super().__init__()
        self.result = result


def fresh_seed(profile: str | None = None) -> int:
    """The seed of a run given none: 0 under a derandomized profile (ci: the same cases every
    run), else 32 random bits (short enough to type back after `--seed`)."""
    if settings.get_profile(profile or default_profile()).derandomize:
        return 0
    return secrets.randbits(32)


def property_failures(exc: BaseException) -> list[PropertyFailed]:
    """The PropertyFailed in `exc`, or in the (nested) exception group `exc`."""
    if isinstance(exc, PropertyFailed):
        return [exc]
    return [f for e in getattr(exc, "exceptions", ()) for f in property_failures(e)]
