"""The bug zoo (CI budget): every injected bug is caught within a few generated cases at world
size 2, by a comparator expected to catch it. `fsdp-verify selftest` without limits is the
nightly version."""

import json
from dataclasses import replace

import pytest

from fsdp_verify.commands.cli import main
from fsdp_verify.commands.selftest import hunt
from fsdp_verify.dims.registry import packages
from fsdp_verify.zoo.catalog import BY_NAME, ZOO

BUDGET = 20  # generated cases per bug


@pytest.mark.parametrize("name", [bug.name for bug in ZOO])
def test_zoo_bug_is_caught_within_the_budget(name):
    bug = BY_NAME[name]
    if bug.framework is not None and bug.off_here():  # a bug planted in a framework not installed here
        pytest.skip(bug.off_here())
    # World size 2, or the smallest the bug can show at (a (2, 2) hybrid mesh needs 4 ranks).
    result = hunt(bug, BUDGET, world_sizes=(2,) if 2 in bug.world_sizes else (min(bug.world_sizes),))
    assert result.status == "caught", f"{name}: {result.status} after {result.examples} cases: {result.detail}"
    assert result.examples <= BUDGET
    assert result.expected_catcher, f"{name} caught by {result.comparator} at {result.phase}, not {bug.catchers}"


def test_every_bug_of_the_issue_is_in_the_zoo():
    required = {
        "grads_divided_twice",
        "grads_not_averaged",
        "reduce_in_bf16",
        "param_dtype_ignored",
        "microbatch_accumulation_overwrites",
        "grad_sync_off_on_last_microbatch",
        "clip_with_local_norm",
        "rank1_different_init",
        "tie_broken_by_sharding",
        "frozen_params_move",
    }
    assert required <= set(BY_NAME)
    # a bug planted around a framework's code lives beside its framework (verify/zoo/torchtitan.py, ...),
    # a dimension package's in its package (verify/dims/float8/mutants.py)
    homes = [f"fsdp_verify.zoo.{(bug.framework or ['mutants'])[0]}" for bug in ZOO]
    dims = {p.mutants for p in packages() if p.mutants}
    assert all(
        bug.engine in (f"{home}:{bug.name}", *(f"{d}:{bug.name}" for d in dims)) for bug, home in zip(ZOO, homes)
    )


def test_a_bug_whose_mutant_does_not_exist_is_reported_missing_not_passed():
    ghost = replace(BY_NAME["grads_divided_twice"], name="ghost", engine="fsdp_verify.zoo.mutants:no_such_mutant")
    result = hunt(ghost, 3, world_sizes=(2,))
    assert (result.status, result.examples) == ("missing", 0)
    assert "no_such_mutant" in result.detail


def test_the_correct_engine_is_not_caught():
    correct = replace(BY_NAME["grads_divided_twice"], name="correct", engine="fsdp2")
    result = hunt(correct, 3, world_sizes=(2,))
    assert (result.status, result.examples) == ("uncaught", 3), result.detail


def test_selftest_cli_prints_the_matrix_and_writes_json(tmp_path, capsys):
    out = tmp_path / "zoo.json"
    code = main(
        ["selftest", "--bugs", "grads_divided_twice", "clip_with_local_norm", "--world-sizes", "2"]
        + ["--max-examples", "5", "--json", str(out)]
    )
    text = capsys.readouterr().out
    assert code == 0, text
    assert "grads_divided_twice" in text and "GradNormComparator" in text and "2/2 bugs caught" in text
    rows = json.loads(out.read_text())
    assert [r["bug"] for r in rows] == ["grads_divided_twice", "clip_with_local_norm"]
    assert all(r["status"] == "caught" and 1 <= r["examples"] <= 5 for r in rows)


def test_selftest_cli_rejects_an_unknown_bug(capsys):
    assert main(["selftest", "--bugs", "nope"]) == 2
    assert "--bugs" in capsys.readouterr().err
