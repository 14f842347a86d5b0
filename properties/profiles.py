"""The Hypothesis profiles every entry point shares (pytest plugin, `fuzz`, the nightly job).

Kept free of torch so the pytest plugin can register them while pytest parses its options:
Hypothesis's own plugin loads `--hypothesis-profile NAME` in its `pytest_configure`, which may
run before ours.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings
from hypothesis.database import DirectoryBasedExampleDatabase

# A case takes 0.2-2 s: no deadline, and slow data generation is no health problem. No `explain`
# phase: after shrinking it reruns the failing case once per choice to say which parts do not
# matter, doubling the cost of a failure; the first divergence already says where it is.
_COMMON = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    "phases": [Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
}
PROFILES = {
    # Quick and reproducible: the same examples every run, nothing remembered between runs.
    "ci": {"max_examples": 10, "derandomize": True, "database": None, "print_blob": False},
    # Many examples; failures are remembered and replayed first on the next night.
    "nightly": {"max_examples": 300, "database": DirectoryBasedExampleDatabase(".hypothesis/fsdp-verify")},
    # A person at a desk: random, a handful of examples, remembered failures. `derandomize` said
    # outright: a profile registered without it inherits Hypothesis's own defaults, which under a
    # CI environment variable are its derandomized "ci" profile (then every seed drawn was 0).
    "dev": {"max_examples": 20, "derandomize": False},
}


# Seconds Hypothesis may shrink a failure for, after the first failure is seen (properties/
# fail_fast.py): short where someone waits (ci, dev), longer for the nightly (where Hypothesis's
# own limit, five minutes, also holds). A profile not named here (a user's own) is not bounded.
SHRINK_SECONDS: dict[str, float | None] = {"ci": 60.0, "dev": 120.0, "nightly": 900.0}


# The share of drawn cases that torch.compile is drawn in (docs/compile.md), for an engine that
# takes it. A compiled case costs what Inductor compiles that no process compiled before: on a
# loaded 2-core machine the first graphs ever compiled into a cache directory cost about two
# minutes (Inductor's C++ headers and its first kernels), a graph in the cache about a second
# more than the eager case (bench/compile.py). CI starts from an empty cache and the README's test
# command must stay short: compiled cases there are dedicated tests (tests/test_compile.py), never
# drawn, and so at a desk (pin `--compile` to draw them). The nightly keeps its cache between
# nights and draws compile in a fifth of its cases (under `eager` and `aot_eager` unpinned:
# strategies.DRAWN_BACKENDS), restored once the fresh-seed hunts' corners were modelled and a
# 200-case sweep with compile in every case was clean (seed 20271401, docs/compile.md).
COMPILE_RATES: dict[str, float] = {"ci": 0.0, "dev": 0.0, "nightly": 0.2}


def profile_compile_rate(profile: str | None = None) -> float:
    """The compile rate of `profile` (default: the Hypothesis profile loaded now); 0 for a profile
    not named in COMPILE_RATES (a user's own, or Hypothesis's default): compile is drawn where a
    budget says so, or pinned."""
    if profile is None:
        get = getattr(settings, "get_current_profile_name", None)
        profile = get() if get is not None else None
    return COMPILE_RATES.get(profile or "", 0.0)


def shrink_seconds(profile: str) -> float | None:
    return SHRINK_SECONDS.get(profile)


def register_profiles() -> None:
    for name, values in PROFILES.items():
        settings.register_profile(name, **_COMMON, **values)


def default_profile() -> str:
    """`ci` when the CI environment variable is set (every major CI service sets it), else `dev`."""
    return "ci" if os.environ.get("CI", "").strip().lower() not in ("", "0", "false") else "dev"
