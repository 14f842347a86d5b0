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


def shrink_seconds(profile: str) -> float | None:
    return SHRINK_SECONDS.get(profile)


def register_profiles() -> None:
    for name, values in PROFILES.items():
        settings.register_profile(name, **_COMMON, **values)


def default_profile() -> str:
    """`ci` when the CI environment variable is set (every major CI service sets it), else `dev`."""
    return "ci" if os.environ.get("CI", "").strip().lower() not in ("", "0", "false") else "dev"
