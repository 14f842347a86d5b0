"""The pytest plugin, run the way users run it: in a fresh pytest process (its Hypothesis profile
is process-wide), with our options, under pytest-xdist."""

import json
import os
from pathlib import Path

from fsdp_verify.case import Case

ROOT = Path(__file__).resolve().parents[1]

pytest_plugins = ("pytester",)

PROPERTY_TEST = """
from hypothesis import given, settings, strategies as st

PINS = {"seed": 0, "data_seed": 1, "init": "eager", "clip_norm": None, "optim.name": "sgd",
        "model.dropout": 0.0, "model.frozen": (), "data.kind": "normal", "data.scale": 1.0}

def test_profile_and_options():
    assert settings.default.max_examples == 2
    assert settings.default.derandomize and settings.default.database is None  # the ci profile
    assert settings.default.deadline is None

@given(data=st.data())
def test_engine_equals_reference(fsdp_cases, fsdp_property, fsdp_world_sizes, data):
    assert fsdp_world_sizes == (2,)
    case = data.draw(fsdp_cases(model_kinds=("mlp",), precisions=("fp32",), **PINS))
    assert case.engine == "fsdp_verify.zoo.mutants:rank1_different_init"
    fsdp_property(case)
"""


def test_a_failing_property_prints_and_writes_the_shrunk_case(pytester, monkeypatch):
    monkeypatch.setenv("CI", "1")
    pytester.makepyfile(test_inner=PROPERTY_TEST)
    result = pytester.runpytest_subprocess(
        "-p",
        "no:cacheprovider",
        "--fsdp-engine",
        "fsdp_verify.zoo.mutants:rank1_different_init",
        "--fsdp-world-sizes",
        "2",
        "--fsdp-max-examples",
        "2",
        "--fsdp-repro-dir",
        "repros",
    )
    result.assert_outcomes(passed=1, failed=1)
    (path,) = (pytester.path / "repros").glob("case-*.json")
    case = Case.load(path)
    assert case.world_size == 2 and case.engine == "fsdp_verify.zoo.mutants:rank1_different_init"
    out = result.stdout.str()
    assert "fsdp-verify: minimal failing case" in out
    assert "First divergence: step 0, initial parameters" in out
    assert f"fsdp-verify repro {path}" in out
    assert "replay the minimal failing cases" in out


XDIST_TEST = """
import json, os
import pytest
from fsdp_verify.case import Case, ModelSpec
from fsdp_verify.case_specs import DataSpec

@pytest.mark.parametrize("seed", range(4))
def test_case_on_this_workers_pool(fsdp_check, fsdp_pool, seed):
    case = Case(model=ModelSpec(kind="mlp", widths=(4, 5, 3)), world_size=2, steps=1, seed=seed,
                data=DataSpec(batch_size=4))
    assert fsdp_check(case).ok
    pool = fsdp_pool(2)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "none")
    with open(f"pools-{worker}-{seed}.json", "w") as f:
        json.dump({"worker": worker, "dir": str(pool._dir), "pids": pool.pids()}, f)
"""


def test_under_xdist_every_worker_has_its_own_pool(pytester):
    pytester.makepyfile(test_inner=XDIST_TEST)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-n", "2")
    result.assert_outcomes(passed=4)
    records = [json.loads(p.read_text()) for p in pytester.path.glob("pools-*.json")]
    by_worker: dict[str, dict] = {}
    for r in records:
        by_worker.setdefault(r["worker"], r)
    assert set(by_worker) <= {"gw0", "gw1"} and len(records) == 4
    if len(by_worker) == 2:  # both workers ran tests: their pools share no dir and no process
        a, b = by_worker.values()
        assert a["dir"] != b["dir"] and not set(a["pids"]) & set(b["pids"])
    assert all(not os.path.exists(r["dir"]) for r in records)  # pools cleaned up at exit


def test_bad_plugin_options_are_usage_errors(pytester):
    pytester.makepyfile(test_inner="def test_nothing():\n    pass\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "--fsdp-world-sizes", "two")
    assert result.ret == 4
    assert "--fsdp-world-sizes" in result.stderr.str()


def test_plugin_options_take_the_commands_spellings_and_the_profile_option_our_profiles(pytester):
    """`--fsdp-world-sizes` and `--fsdp-precisions` parse as `fuzz --world-sizes/--precisions` do:
    comma- or space-separated, long dtype names accepted, short names seen; and `--hypothesis-profile
    nightly|dev|ci` names our profiles, which must exist before Hypothesis's own plugin loads the
    chosen one. One inner run for both (a fresh pytest process each costs seconds)."""
    pytester.makepyfile(
        test_inner="from hypothesis import settings\n\n"
        "def test_options(fsdp_world_sizes, request):\n"
        "    assert fsdp_world_sizes == (2, 4)\n"
        "    assert request.config.getoption('--fsdp-precisions') == ('fp32', 'bf16')\n\n"
        "def test_profile():\n"
        "    assert settings.get_current_profile_name() == 'nightly'\n"
        "    assert settings.default.max_examples == 300 and settings.default.deadline is None\n"
    )
    args = ["-p", "no:cacheprovider", "--fsdp-world-sizes", "2 4", "--fsdp-precisions", "float32,bfloat16"]
    result = pytester.runpytest_subprocess(*args, "--hypothesis-profile", "nightly")
    result.assert_outcomes(passed=2)


CRASHING_TEST = """
from hypothesis import given, strategies as st

@given(data=st.data())
def test_my_engine(fsdp_cases, fsdp_property, data):
    fsdp_property(data.draw(fsdp_cases(model_kinds=("mlp",), precisions=("fp32",))))
"""


def test_a_failing_property_says_and_saves_its_first_failure_at_once_and_bounds_its_shrinking(pytester):
    """The README's example on an engine whose rank 1 dies in every forward, from an xdist worker:
    the first failing case is written to the repro dir and said on the terminal past pytest's
    capture the moment it fails; with a shrink budget of 0 s nothing runs after it, so the case
    reported is that one, with a note that shrinking was cut short."""
    pytester.makepyfile(test_inner=CRASHING_TEST)
    engine = str(ROOT / "tests" / "engines" / "faulty.py") + ":rank1_crashes_in_forward"
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-n", "1", "--fsdp-engine", engine, "--fsdp-world-sizes", "2",
        "--fsdp-max-examples", "5", "--fsdp-shrink-seconds", "0", "--fsdp-repro-dir", "repros",
    )  # fmt: skip
    result.assert_outcomes(failed=1)
    (first,) = (pytester.path / "repros").glob("first-failure-*.json")
    (shrunk,) = (pytester.path / "repros").glob("case-*.json")
    assert first.name.removeprefix("first-failure-") == shrunk.name.removeprefix("case-")
    said = result.stderr.str()
    assert "test_inner.py::test_my_engine: first failure, " in said, said
    assert "rank 1 crash in phase 'step 1 forward (micro-batch 0)'" in said and f"saved: {first}" in said
    assert "Hypothesis shrinks it, at most 0 s (--fsdp-shrink-seconds)" in said
    out = result.stdout.str()
    assert "Note: shrinking stopped 0 s after the first failure (the shrink budget)" in out
    assert f"fsdp-verify repro {shrunk}" in out
