"""pytest plugin (entry point `pytest11`): per-process rank pools, fixtures that check a case or a
property, generated cases configured from the command line, Hypothesis profiles, and minimal
repro files for failing properties.

Under pytest-xdist every worker is its own process and so gets its own pools (FileStore
rendezvous in a private temp dir: no ports or files shared between workers) and, on a GPU runner,
its own disjoint slice of the GPUs (verify/sharded/devices.py). Repro files are named by the Case's hash,
so two workers never write one file with different contents.

    from hypothesis import given, strategies as st

    @given(data=st.data())
    def test_my_engine(fsdp_cases, fsdp_property, data):
        fsdp_property(data.draw(fsdp_cases(model_kinds=("mlp",))))
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

REPRO_SECTION = "fsdp-verify: minimal failing case"


def pytest_addoption(parser: pytest.Parser) -> None:
    from fsdp_verify.commands.options import ENGINE_HELP, engine_name
    from fsdp_verify.properties.profiles import register_profiles

    register_profiles()  # before any plugin's pytest_configure loads --hypothesis-profile
    group = parser.getgroup("fsdp-verify")
    group.addoption("--fsdp-engine", type=engine_name, default="fsdp2", help=f"engine under test ({ENGINE_HELP})")
    group.addoption(
        "--fsdp-step",
        default=None,
        help="your training step pkg.module:NAME or file.py:NAME for generated cases (fsdp_cases)",
    )
    group.addoption("--fsdp-timeout", type=float, default=120.0, help="seconds before a rank counts as hung")
    group.addoption(
        "--fsdp-world-sizes",
        type=_world_sizes,
        default=(1, 2, 3, 4),
        help="world sizes generated cases use, comma- or space-separated (default 1,2,3,4)",
    )
    group.addoption(
        "--fsdp-precisions",
        type=_precisions,
        default=("fp32", "bf16"),
        help="precision policies generated cases use: fp32,bf16 (float32, bfloat16 accepted; default both)",
    )
    group.addoption(
        "--fsdp-max-examples",
        type=int,
        default=None,
        help="generated cases per property test (overrides the Hypothesis profile's max_examples)",
    )
    group.addoption(
        "--fsdp-shrink-seconds",
        type=float,
        default=None,
        help="stop Hypothesis's shrinking this long after a test's first failure, reporting the smallest"
        " failing case found by then (default: the profile's: ci 60, dev 120, nightly 900)",
    )
    group.addoption(
        "--fsdp-repro-dir",
        default="fsdp-verify-repros",
        help="where a failing property writes its shrunk Case file (default ./fsdp-verify-repros)",
    )


def _world_sizes(text: str) -> tuple[int, ...]:
    from fsdp_verify.commands.options import world_sizes

    return tuple(world_sizes(text))


def _precisions(text: str) -> tuple[str, ...]:
    from fsdp_verify.commands.options import precisions

    return tuple(precisions(text))


@pytest.hookimpl(trylast=True)  # after Hypothesis's own plugin has loaded --hypothesis-profile
def pytest_configure(config: pytest.Config) -> None:
    """Register the `ci`, `nightly` and `dev` profiles; unless --hypothesis-profile chose one, load
    `ci` when the CI variable is set, else `dev`; then apply --fsdp-max-examples."""
    from hypothesis import settings

    from fsdp_verify.properties.profiles import default_profile

    profile = config.getoption("hypothesis_profile", None)
    if not profile:
        profile = default_profile()
        settings.load_profile(profile)
    config.stash[_PROFILE] = profile
    seconds = config.getoption("--fsdp-shrink-seconds")
    if seconds is not None and not seconds >= 0:
        raise pytest.UsageError(f"--fsdp-shrink-seconds: expected a number of seconds >= 0, got {seconds}")
    n = config.getoption("--fsdp-max-examples")
    if n is not None:
        if n < 1:
            raise pytest.UsageError(f"--fsdp-max-examples: expected a positive integer, got {n}")
        name = f"{settings.get_current_profile_name()}-fsdp-max-examples-{n}"
        settings.register_profile(name, max_examples=n)  # the current profile, with max_examples
        settings.load_profile(name)


# ---- fixtures -----------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def fsdp_engine(request: pytest.FixtureRequest) -> str:
    return request.config.getoption("--fsdp-engine")


@pytest.fixture(scope="session")
def fsdp_world_sizes(request: pytest.FixtureRequest) -> tuple[int, ...]:
    return request.config.getoption("--fsdp-world-sizes")


@pytest.fixture(scope="session")
def fsdp_repro_dir(request: pytest.FixtureRequest) -> Path:
    return _repro_dir(request.config)


@pytest.fixture(scope="session")
def fsdp_pool(request: pytest.FixtureRequest):
    """`fsdp_pool(world_size) -> RankPool`: this process's warm pool (one per xdist worker)."""
    from fsdp_verify.sharded.pool import get_pool

    timeout = request.config.getoption("--fsdp-timeout")
    return lambda world_size: get_pool(world_size, timeout)


@pytest.fixture(scope="session")
def fsdp_check(request: pytest.FixtureRequest, fsdp_pool):
    """`fsdp_check(case) -> Verdict`, run on this process's warm pool for the case's world size.
    Session-scoped, so it can be used inside Hypothesis tests."""
    from fsdp_verify.runner import check_case

    timeout = request.config.getoption("--fsdp-timeout")

    def check(case, **kwargs):
        kwargs.setdefault("timeout_s", timeout)
        return check_case(case, pool=fsdp_pool(case.world_size), **kwargs)

    return check


@pytest.fixture(scope="session")
def fsdp_property(request: pytest.FixtureRequest, fsdp_pool):
    """`fsdp_property(case, name="sharded-equals-reference") -> Verdict`; raises PropertyFailed
    (the plugin then writes the shrunk Case file and prints its replay command)."""
    from fsdp_verify.properties.properties import PROPERTIES

    timeout = request.config.getoption("--fsdp-timeout")

    def check(case, name: str = "sharded-equals-reference", **kwargs):
        if name not in PROPERTIES:
            raise ValueError(f"property: expected one of {sorted(PROPERTIES)}, got {name!r}")
        kwargs.setdefault("timeout_s", timeout)

        def run(c):
            return PROPERTIES[name](c, pool=fsdp_pool(c.world_size), **kwargs)

        if _memory is None:  # outside a test's call (a fixture's setup)
            return run(case)
        return _memory(case, run, key=(name, case.hash, repr(sorted(kwargs.items()))))

    return check


# ---- failing fast (properties/fail_fast.py) -----------------------------------------------------
_PROFILE = pytest.StashKey[str]()
_MEMORY = pytest.StashKey[object]()
_memory = None  # the running test's FailFast: what its cases gave, its first failure, its clock


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item):
    """Each test is one search: its first failure is saved and said at once, before Hypothesis
    shrinks it, and shrinking stops after the profile's budget (--fsdp-shrink-seconds)."""
    global _memory
    from fsdp_verify.properties.fail_fast import FailFast
    from fsdp_verify.properties.profiles import shrink_seconds

    seconds = item.config.getoption("--fsdp-shrink-seconds")
    budget = shrink_seconds(item.config.stash.get(_PROFILE, "")) if seconds is None else seconds
    _memory = item.stash[_MEMORY] = FailFast(budget, lambda failure: _first_failure(item, failure, budget))
    try:
        yield
    finally:
        _memory = None


def _first_failure(item: pytest.Item, failure, budget: float | None) -> None:
    """Write the first failing Case to the repro dir and say so on the terminal now (past
    pytest's capture; from an xdist worker too, whose stderr is the terminal's)."""
    from fsdp_verify.properties.fail_fast import first_failure_file
    from fsdp_verify.repro.files import replay_command

    path = first_failure_file(failure, _repro_dir(item.config))
    seconds = item.stash[_MEMORY].first_failure_at
    limit = f"at most {budget:g} s" if budget is not None else "without a time limit"
    text = (
        f"\nfsdp-verify: {item.nodeid}: first failure, {seconds:.1f} s in: {failure.first_divergence}"
        f" (case {failure.case.hash})\n  saved: {path}\n  replay: {replay_command(path)}\n"
        f"  Hypothesis shrinks it, {limit} (--fsdp-shrink-seconds)\n"
    )
    capture = item.config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
        sys.stderr.write(text)
        sys.stderr.flush()


@pytest.fixture(scope="session")
def fsdp_cases(request: pytest.FixtureRequest) -> Callable:
    """`fsdp_cases(**pins) -> SearchStrategy[Case]`: `fsdp_verify.properties.strategies.cases` with the engine,
    world sizes and precisions from the command line as defaults. Pins by field name or by `check`'s
    flag names (`optimizer=["adam", "sgd"]`, `sync_last=True`); `model="file.py:NAME"` as `--model`."""
    from fsdp_verify.properties.strategies import cases

    config = request.config
    defaults = {
        "engine": config.getoption("--fsdp-engine"),
        "world_sizes": config.getoption("--fsdp-world-sizes"),
        "precisions": config.getoption("--fsdp-precisions"),
    }
    step = config.getoption("--fsdp-step")
    if step is not None:
        defaults["step"] = step
    return lambda **pins: cases(**{**defaults, **pins})


# ---- minimal repros -----------------------------------------------------------------------------
def _repro_dir(config: pytest.Config) -> Path:
    path = Path(config.getoption("--fsdp-repro-dir"))
    return path if path.is_absolute() else config.invocation_params.dir / path


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A failing property (after Hypothesis's shrinking, this is the smallest failing Case):
    write its Case file before the report is rendered, so the failure message ends with the
    replay command, and add a section with the Case, its first divergence and that command."""
    failures = []
    if call.when == "call" and call.excinfo is not None:
        from fsdp_verify.properties.search import property_failures

        failures = property_failures(call.excinfo.value)
        for failure in failures:
            if failure.repro_path is None:
                failure.write_repro(_repro_dir(item.config))
    outcome = yield
    if failures:
        from fsdp_verify.repro.files import replay_command

        report = outcome.get_result()
        for failure in failures:
            lines = [
                failure.summary(),
                f"First divergence: {failure.first_divergence}",
                f"Shrunk case written to {failure.repro_path}:",
                failure.case.to_json(),
            ]
            memory = item.stash.get(_MEMORY, None)
            note = memory.stopped_note() if memory is not None else None
            if note:
                lines.insert(0, f"Note: {note}.")
            text = "\n".join([*lines, f"Replay: {replay_command(failure.repro_path)}"])
            report.sections.append((REPRO_SECTION, text))


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    lines = [
        content.rsplit("\n", 1)[-1]
        for report in terminalreporter.stats.get("failed", [])
        for title, content in report.sections
        if title == REPRO_SECTION
    ]
    if lines:
        terminalreporter.section("fsdp-verify: replay the minimal failing cases")
        for line in lines:
            terminalreporter.line(line.removeprefix("Replay: "))
