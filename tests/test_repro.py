"""`fsdp-verify repro`: exit 0 when the engine agrees, 1 when it diverges, 125 when the case
cannot be run at this revision, as `git bisect run` needs."""

import json
import shutil
import sys
from pathlib import Path

import pytest

from fsdp_verify import launch
from fsdp_verify.commands.cli import main
from tests.conftest import mlp_case

ROOT = Path(__file__).resolve().parent.parent


def test_repro_exits_0_when_the_engine_agrees(tmp_path, capsys):
    path = mlp_case(2, steps=1).save(tmp_path / "case.json")
    assert main(["repro", str(path)]) == 0
    assert "EQUIVALENT" in capsys.readouterr().out


def test_repro_exits_1_when_it_diverges_and_engine_override_wins(tmp_path, capsys):
    path = mlp_case(2, steps=1).save(tmp_path / "case.json")  # the file names the correct engine
    verdict = tmp_path / "verdict.json"
    code = main(["repro", str(path), "--engine", "fsdp_verify.zoo.mutants:grads_divided_twice", "--json", str(verdict)])
    assert code == 1
    assert "still diverges" in capsys.readouterr().out
    assert json.loads(verdict.read_text())["first_divergence"]["phase"] == "grads"


def _bad_field(tmp_path: Path) -> list[str]:
    data = mlp_case(2).to_dict()
    data["optim"]["name"] = "lamb"
    (tmp_path / "case.json").write_text(json.dumps(data))
    return [str(tmp_path / "case.json")]


def _unknown_field(tmp_path: Path) -> list[str]:  # a case from a newer revision
    data = mlp_case(2).to_dict()
    data["sequence_parallel"] = True
    (tmp_path / "case.json").write_text(json.dumps(data))
    return [str(tmp_path / "case.json")]


def _engine_file_missing(tmp_path: Path) -> list[str]:
    path = mlp_case(2).save(tmp_path / "case.json")
    return [str(path), "--engine", str(tmp_path / "engine.py") + ":shard"]


def _engine_does_not_import(tmp_path: Path) -> list[str]:
    (tmp_path / "engine.py").write_text("import no_such_module_at_this_revision\n")
    path = mlp_case(2).save(tmp_path / "case.json")
    return [str(path), "--engine", str(tmp_path / "engine.py") + ":shard"]


def _case_file_missing(tmp_path: Path) -> list[str]:
    return [str(tmp_path / "case.json")]


@pytest.mark.parametrize(
    ("make_args", "message"),
    [
        (_bad_field, "optim.name"),
        (_unknown_field, "sequence_parallel"),
        (_engine_file_missing, "no such file"),
        (_engine_does_not_import, "no_such_module_at_this_revision"),
        (_case_file_missing, "No such file"),
    ],
)
def test_repro_exits_125_when_the_case_cannot_run_here(tmp_path, capsys, make_args, message):
    assert main(["repro", *make_args(tmp_path)]) == 125
    err = capsys.readouterr().err
    assert message in err and "exit 125" in err


def test_repro_exits_125_when_the_toolkit_itself_does_not_import(tmp_path):
    """A revision where the toolkit is broken (here: a module the CLI imports raises) is skipped,
    not blamed on the engine. A copy of the toolkit with one module broken stands in for it."""
    # The checkout as installed: verify/ is fsdp_verify, reference/ and properties/ inside it.
    copy = tmp_path / "fsdp_verify"
    shutil.copytree(ROOT / "verify", copy, ignore=shutil.ignore_patterns("__pycache__"))
    for package in ("reference", "properties"):
        shutil.copytree(ROOT / package, copy / package, ignore=shutil.ignore_patterns("__pycache__"))
    broken = copy / "commands" / "check.py"
    broken.write_text(broken.read_text() + '\nraise ImportError("broken at this revision")\n')
    path = mlp_case(2).save(tmp_path / "case.json")
    r = launch.run(
        [sys.executable, "-m", "fsdp_verify", "repro", str(path)],
        cwd=tmp_path,
        timeout=300,
    )
    assert r.returncode == 125, r.stdout + r.stderr
    assert "broken at this revision" in r.stderr and str(copy) in r.stderr  # the copy ran
    r = launch.run([sys.executable, "-m", "fsdp_verify", "repro", str(path), "--no-such-flag"], cwd=ROOT, timeout=300)
    assert r.returncode == 125, r.stdout + r.stderr  # a flag this revision lacks: skip, never "bad"


def test_repro_rank_crash_is_bad_not_skip(tmp_path, capsys):
    """Last in the file: the crash costs the pool a restart."""
    path = mlp_case(2, steps=1, engine=str(ROOT / "tests/engines/faulty.py") + ":rank1_crashes_in_forward")
    assert main(["repro", str(path.save(tmp_path / "case.json")), "--timeout", "60"]) == 1
    assert "counts as a broken engine" in capsys.readouterr().err
