"""`find` for the tests that ask whether the draw reaches a kind of case: the first drawn example
that satisfies the condition, not shrunk. Shrinking a found Case to the smallest one took 5-8 s a
test (most of a minute in some) and shows nothing an existence test asserts."""

from __future__ import annotations

from hypothesis import Phase, settings
from hypothesis import find as hypothesis_find

# The search without the shrink phase (for `find(..., settings=FOUND)` with another budget).
FOUND = settings(
    max_examples=2000, database=None, phases=(Phase.explicit, Phase.reuse, Phase.generate), derandomize=True
)


def find(strategy, condition, max_examples: int = 2000):
    return hypothesis_find(strategy, condition, settings=settings(FOUND, max_examples=max_examples))
