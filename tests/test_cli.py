"""The command line, as a user runs it: exit codes 0 / 1 / 2 / 3 and the JSON verdict.

One test of each exit code runs `python -m fsdp_verify` in a process of its own (the exit status a
shell sees); the others call the command in this process (tests/in_process.py: the same `main`,
without starting torch twice more)."""

import json
import sys

import pytest

from fsdp_verify import launch
from tests.in_process import run_cli


def fsdp_verify(*args, timeout=300):
    """In a process of its own, as a shell runs it."""
    return launch.run([sys.executable, "-m", "fsdp_verify", *args], timeout=timeout)


def test_check_default_case_passes_and_writes_json(tmp_path):
    out = tmp_path / "verdict.json"
    page = tmp_path / "verdict.html"
    r = fsdp_verify("check", "--json", str(out), "--html", str(page))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "EQUIVALENT" in page.read_text() and "<svg" in page.read_text()
    assert "EQUIVALENT" in r.stdout
    verdict = json.loads(out.read_text())
    assert verdict["ok"] is True and verdict["first_divergence"] is None
    assert verdict["case"]["model"]["kind"] == "transformer" and verdict["case"]["world_size"] == 2
    # A passing check shows what it checked: ownership, precision contract and RNG say "ok".
    header, step0 = (line.split() for line in r.stdout.splitlines()[:2])
    row = dict(zip(header, step0))
    assert (row["ownership"], row["precision"], row["rng"]) == ("ok", "ok", "ok"), r.stdout
    checks = {f["comparator"]: f["message"] for f in verdict["findings"] if f["kind"] == "check"}
    assert {"OwnershipCheck", "PrecisionContract", "RngCheck"} <= set(checks), checks


def test_json_dash_is_standard_output_alone_and_writes_no_file(tmp_path):
    """`--json -` (the Unix spelling): the document alone on standard output, the text for a person
    on standard error, no file named "-" left behind; the same for a command's other JSON."""
    r = run_cli(["check", "--model", "mlp", "--steps", "1", "--json", "-"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["ok"] is True and "EQUIVALENT" in r.stderr
    r = run_cli(["comm", "--model", "mlp", "--steps", "1", "--json", "-"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert isinstance(json.loads(r.stdout), dict)
    assert not (tmp_path / "-").exists()


@pytest.mark.parametrize("spelling", [("bf16", "fp32"), ("bfloat16", "float32")], ids=["short", "long"])
def test_check_takes_every_dtype_spelling_and_prints_the_short_one(tmp_path, spelling):
    """`check --param-dtype bf16` works as `fuzz --precisions bf16` does; both print `bf16`."""
    out = tmp_path / "verdict.json"
    args = ["--model", "mlp", "--steps", "1", "--param-dtype", spelling[0], "--reduce-dtype", spelling[1]]
    r = run_cli(["check", *args, "--json", str(out)])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "param bf16, reduce fp32" in r.stdout and "bfloat16" not in r.stdout
    precision = json.loads(out.read_text())["case"]["precision"]
    assert (precision["param_dtype"], precision["reduce_dtype"]) == ("bf16", "fp32")


def test_check_mutant_exits_1_and_names_first_divergence(tmp_path):
    out = tmp_path / "verdict.json"
    page = tmp_path / "verdict.html"
    args = [
        "--model",
        "mlp",
        "--engine",
        "fsdp_verify.zoo.mutants:grads_divided_twice",
        "--json",
        str(out),
        "--html",
        str(page),
    ]
    r = fsdp_verify("check", *args)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "DIVERGED" in page.read_text() and "FAIL" in page.read_text()
    first = json.loads(out.read_text())["first_divergence"]
    assert (first["step"], first["phase"]) == (1, "grads")
    assert "First divergence at step 1, gradients" in r.stdout
    rerun = "Rerun from flags: fsdp-verify check --model mlp --engine fsdp_verify.zoo.mutants:grads_divided_twice"
    assert rerun in r.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--world-size", "0"], "world_size"),
        (["--batch-size", "7", "--world-size", "2"], "data.batch_size"),
        (["--engine", "no_such_module:engine"], "cannot import"),
        (["--engine", "fsdp_verify.zoo.mutants:no_such_engine"], "no callable"),
        (["--steps", "many"], "invalid int value"),
        (["--param-dtype", "bf17"], "--param-dtype: expected a dtype (fp32/float32, bf16/bfloat16"),
        (["--timeout", "-5"], "--timeout: expected a positive number of seconds, got '-5'"),
        (["--case", "no_such_case.json"], "bad case: --case: expected a Case JSON file, got 'no_such_case.json'"),
        (["--timeout", "0"], "--timeout: expected a positive number of seconds, got '0'"),
        (["--engine", "fsdp3"], "engine: expected 'fsdp2', 'fsdp1', 'flat', 'pkg.module:NAME'"),
        # a model factory given as the engine: named here, not a rank's TypeError (exit 3) mid-case
        (["--engine", "tests/user/models.py:user_lm"], "expected a callable engine(model, mesh, spec) -> module"),
        (["--model", "no_such_dir/model.py:make"], "(a relative path is read from the current directory, "),
        (
            ["--model", "fsdp_verify.models.hf:tiny_llama", "--model-kwargs", '{"num_hiden_layers": 1}'],
            "LlamaConfig has no field 'num_hiden_layers'",
        ),
    ],
)
def test_bad_input_exits_2_and_names_the_field(args, message):
    # the first in a process of its own (the exit status a shell sees), the others in this one
    r = fsdp_verify("check", *args) if args == ["--world-size", "0"] else run_cli(["check", *args])
    assert r.returncode == 2, r.stdout + r.stderr
    assert message in r.stderr


def test_bad_case_file_exits_2(tmp_path):
    bad = tmp_path / "case.json"
    bad.write_text(json.dumps({"optim": {"name": "lamb"}}))
    r = run_cli(["check", "--case", str(bad)])
    assert r.returncode == 2 and "optim.name" in r.stderr


def test_crashed_rank_exits_3_naming_rank_and_phase():
    r = fsdp_verify(
        "check", "--model", "mlp", "--engine", "tests/engines/faulty.py:rank1_crashes_in_forward", "--timeout", "30"
    )
    assert r.returncode == 3, r.stdout + r.stderr
    assert "rank 1 crash in phase 'step 1 forward" in r.stderr


def test_engine_names_and_model_lists_take_the_spellings_users_type(tmp_path):
    """`--engine FSDP1` runs and prints `fsdp1` (one spelling); `--models` takes commas as
    `--world-sizes` and `--precisions` do."""
    r = run_cli(["check", "--engine", "FSDP1", "--model", "mlp", "--steps", "1"])
    assert r.returncode == 0 and "EQUIVALENT: fsdp1 vs the reference" in r.stdout, r.stdout + r.stderr
    args = ["--models", "mlp,transformer", "--world-sizes", "1", "--cases", "2", "--no-progress"]
    r = run_cli(["sweep", *args, "--out", str(tmp_path)])
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["counts"]["cases"] == 2


@pytest.mark.parametrize("engine", ["flat"])
def test_an_engine_that_cannot_take_the_mesh_is_bad_input_before_any_rank_starts(tmp_path, engine):
    """Each engine declares the meshes it takes (verify/engines/capabilities.py): a 2-D mesh for a
    1-D engine exits 2 naming the field, not 3 as if a rank had crashed."""
    from fsdp_verify.case import Case, ModelSpec
    from fsdp_verify.case_specs import DataSpec

    path = tmp_path / "case.json"
    Case(model=ModelSpec(kind="mlp", widths=(4, 3)), world_size=2, mesh_shape=(1, 2), data=DataSpec(batch_size=2)).save(
        path
    )
    r = run_cli(["check", "--case", str(path), "--engine", engine])
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"mesh_shape: expected a 1-D mesh (shard,): what engine {engine!r} takes, got (1, 2)" in r.stderr
    assert "infrastructure" not in r.stderr
    r = run_cli(["sweep", "--engine", engine, "--hsdp", "--pin", "mesh_shape=[2,2]", "--out", str(tmp_path / "s")])
    assert r.returncode == 2 and "mesh_shape: expected a 1-D mesh" in r.stderr, r.stdout + r.stderr


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"mesh_shape": (2, 1), "engine": "flat"},
            r"mesh_shape: expected a 1-D mesh \(shard,\): what engine 'flat' takes",
        ),
        (
            {"precision.output_dtype": "fp32", "engine": "fsdp1"},
            "precision.output_dtype: expected null: engine 'fsdp1'",
        ),
        ({"world_size": 4, "mesh_shape": (4, 1), "reshard_after_forward": 2}, "reshard_after_forward: expected .* 1 "),
        (
            {"world_size": 4, "reshard_after_forward": 3},
            "reshard_after_forward: expected .* dividing the shard dimension 4",
        ),
    ],
    ids=["flat-2d-mesh", "fsdp1-output-dtype", "fsdp2-reshard-to-2-of-1", "fsdp2-reshard-to-3-of-4"],
)
def test_the_runner_refuses_what_the_engine_cannot_take_without_touching_a_rank(changes, message):
    """FSDP2 raises inside fully_shard for an int reshard_after_forward that does not divide the
    shard group, FSDP1 for an output_dtype: both refused in the parent (CaseError, exit 2)."""
    from fsdp_verify.engines import engine_capabilities
    from fsdp_verify.runner import check_case
    from fsdp_verify.validation import CaseError
    from tests.conftest import mlp_case

    case = mlp_case(2).with_(**{"data.batch_size": 8, **changes})
    with pytest.raises(CaseError, match=message):
        check_case(case, pool=object())  # a pool used would raise AttributeError
    # FSDP1 takes an int reshard_after_forward as FULL_SHARD, whatever it divides: not refused.
    engine_capabilities("fsdp1").refuse(mlp_case(2, engine="fsdp1", reshard_after_forward=3), "fsdp1")
