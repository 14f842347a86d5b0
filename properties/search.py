"""Running a property over generated Cases outside pytest (the `fuzz` command, the nightly job,
the toolkit's own tests), and the Hypothesis profiles every entry point shares.

Hypothesis does the search and the shrinking: the property raises `PropertyFailed`, Hypothesis
shrinks the Case and finally replays the smallest failing one, whose exception `search` returns.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import hypothesis
from hypothesis import given, settings
from hypothesis.strategies import SearchStrategy

from fsdp_verify.case import Case
from fsdp_verify.properties.failure import PropertyFailed
from fsdp_verify.properties.profiles import default_profile, register_profiles
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
    on_example: Callable[[Example], None] | None = None,
) -> SearchResult:
    """Run `prop` on cases drawn from `strategy` until one fails (then shrink it) or
    `max_examples` pass. Returns every example run (shrinking included) and the shrunk failure."""
    base = settings.get_profile(profile or default_profile())
    overrides = {"max_examples": max_examples} if max_examples is not None else {}
    if seed is not None:
        overrides["derandomize"] = False
    result = SearchResult()

    def body(case: Case) -> None:
        t0 = time.perf_counter()
        try:
            verdict = prop(case)
        except PropertyFailed as e:
            _record(Example(case, False, time.perf_counter() - t0, e.verdict, e))
            raise
        _record(Example(case, True, time.perf_counter() - t0, verdict))

    def _record(example: Example) -> None:
        result.examples.append(example)
        if on_example is not None:
            on_example(example)

    test = settings(base, **overrides)(given(strategy)(body))
    if seed is not None:
        test = hypothesis.seed(seed)(test)
    t0 = time.perf_counter()
    try:
        test()
    except PropertyFailed as e:
        result.failure = e
    except Exception as e:  # an ExceptionGroup of several distinct failures: report the first
        failures = property_failures(e)
        if not failures:
            raise
        result.failure = failures[0]
    result.seconds = time.perf_counter() - t0
    return result


def property_failures(exc: BaseException) -> list[PropertyFailed]:
    """The PropertyFailed in `exc`, or in the (nested) exception group `exc`."""
    if isinstance(exc, PropertyFailed):
        return [exc]
    return [f for e in getattr(exc, "exceptions", ()) for f in property_failures(e)]
