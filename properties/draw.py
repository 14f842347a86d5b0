"""A fixed list of generated Cases for a seed: the sweep draws every case before it runs any, so
what is drawn cannot depend on what ran (a failure, a skipped shard, a resumed run). N runners
with the same seed see the same list and split it by index."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.strategies import SearchStrategy

from fsdp_verify.case import Case


def draw_cases(strategy: SearchStrategy[Case], count: int, seed: int) -> list[Case]:
    """`count` cases from `strategy`, the same ones for the same seed on every machine."""
    drawn: list[Case] = []

    @hypothesis_seed(seed)
    @settings(
        max_examples=count,
        database=None,
        deadline=None,
        phases=(Phase.generate,),
        suppress_health_check=list(HealthCheck),
        derandomize=False,
        print_blob=False,
    )
    @given(strategy)
    def collect(case: Case) -> None:
        drawn.append(case)

    with _no_local_constants():
        collect()
    return drawn[:count]


@contextmanager
def _no_local_constants() -> Iterator[None]:
    """Hypothesis mixes in constants from the local (not site-packages) modules loaded so far, so
    one seed draws other cases once more modules are imported, or where the package is installed
    as a wheel rather than editable. Without them the draw depends on the seed, the strategy and
    the Hypothesis version only."""
    try:
        from hypothesis.internal.conjecture import providers
    except ImportError:  # another Hypothesis layout: nothing to switch off
        yield
        return
    original = getattr(providers, "_get_local_constants", None)
    if original is None or not hasattr(providers, "Constants"):
        yield
        return
    empty = providers.Constants()
    providers._get_local_constants = lambda: empty
    providers.CONSTANTS_CACHE.cache.clear()
    try:
        yield
    finally:
        providers._get_local_constants = original
        providers.CONSTANTS_CACHE.cache.clear()


def in_shard(index: int, shard: tuple[int, int]) -> bool:
    """Shard (I, N), 1-based, runs the cases whose index k has k % N == I - 1."""
    i, n = shard
    return index % n == i - 1
