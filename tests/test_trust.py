"""A case file is data: the code it names (model factory, init and output functions, data, loss,
step, engine) runs only when allowed (verify/trust.py). Each refusal is checked by what did NOT
happen: the named file writes a marker when imported, and the marker must not exist."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_verify import launch
from fsdp_verify.case import Case
from fsdp_verify.commands.cli import main
from fsdp_verify.trust import ENV, code_names, refuse_untrusted
from fsdp_verify.validation import CaseError
from tests.conftest import mlp_case

ROOT = Path(__file__).resolve().parent.parent
# A toolkit model as the factory, so a case can name its init and output functions alone.
TOOLKIT_LM = {
    "kind": "custom",
    "factory": "fsdp_verify.models.transformer:Transformer",
    "kwargs": {"vocab_size": 17, "dim": 8, "n_layers": 1, "n_heads": 2, "ffn_hidden": 12, "seq_len": 8},
}
REFUSED = "names code it would import and run"


def user_code(folder: Path, name: str = "code.py") -> tuple[Path, Path]:
    """A user's file whose import alone writes a marker: (the file, the marker)."""
    marker = folder / f"{name}.imported"
    (folder / name).write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('imported')\n\n"
        "def anything(*args, **kwargs):\n    raise SystemExit('called')\n\n"
        "def one_arg(x):  # a step of the wrong signature: bad input once imported, no rank runs\n    return x\n"
    )
    return folder / name, marker


def case_naming(field: str, name: str) -> dict:
    """A valid case (a small MLP) but for `field` naming `name`."""
    data = mlp_case(1, steps=1).to_dict()
    if field.startswith("model."):
        data["model"] = {**TOOLKIT_LM, field.removeprefix("model."): name}
    elif field == "data.fn":
        data["data"]["fn"] = name
    else:
        data[field] = name
    return data


def write(folder: Path, data: dict) -> Path:
    path = folder / "case.json"
    path.write_text(json.dumps(data))
    return path


CODE_FIELDS = ("model.factory", "model.init_fn", "model.output_fn", "data.fn", "loss", "step", "engine")


@pytest.mark.parametrize("field", CODE_FIELDS)
def test_each_code_field_of_a_case_file_is_refused_before_its_code_is_imported(field, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no pyproject.toml above a temp folder, so nothing is allow-listed
    monkeypatch.delenv(ENV, raising=False)
    _, marker = user_code(tmp_path)
    path = write(tmp_path, case_naming(field, "code.py:anything"))
    assert main(["check", "--case", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{field}: 'code.py:anything'" in err and REFUSED in err
    assert "--trust-code" in err and f"{ENV}=1" in err and 'trusted = ["code.py"]' in err
    assert not marker.exists()  # not imported, let alone called
    assert main(["shrink", str(path)]) == 2 and main(["repro", str(path)]) == 125  # git bisect's skip, never bad
    assert REFUSED in capsys.readouterr().err and not marker.exists()


def test_every_refused_name_is_listed_at_once():
    data = case_naming("model.init_fn", "a.py:init")
    data.update(step="steps.train:step", engine="e.py:shard")
    user = {("model.init_fn", "a.py:init"), ("engine", "e.py:shard"), ("step", "steps.train:step")}
    assert set(code_names(data)) == user | {("model.factory", TOOLKIT_LM["factory"])}
    with pytest.raises(CaseError) as e:
        refuse_untrusted(data, "case.json")
    assert e.value.refused and set(e.value.refused) == user  # the toolkit's factory is not refused
    assert code_names({"model": {"kwargs": {"args": "a:b"}}}) == []  # the factory's arguments are data


def _allowed_and_imported(args: list[str], marker: Path, capsys) -> None:
    """The step file was imported (its marker exists) and judged on its merits: a step of the
    wrong signature is bad input named `step`, reported before any rank starts."""
    assert main(["check", *args]) == 2
    err = capsys.readouterr().err
    assert REFUSED not in err and "step: expected a callable NAME(model, optimizer, batch, ctx)" in err
    assert marker.exists()


def test_trust_code_flag_allows_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(ENV, raising=False)
    _, marker = user_code(tmp_path)
    path = write(tmp_path, case_naming("step", "code.py:one_arg"))
    _allowed_and_imported(["--case", str(path), "--trust-code"], marker, capsys)


def test_the_environment_variable_allows_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _, marker = user_code(tmp_path)
    path = write(tmp_path, case_naming("step", "code.py:one_arg"))
    monkeypatch.setenv(ENV, "0")
    assert main(["check", "--case", str(path)]) == 2 and REFUSED in capsys.readouterr().err
    monkeypatch.setenv(ENV, "1")
    _allowed_and_imported(["--case", str(path)], marker, capsys)


def test_what_the_command_line_names_is_allowed(tmp_path, monkeypatch, capsys):
    """`--step ./code.py:one_arg` typed here allows the file's `code.py:one_arg` (one file, two
    spellings); it allows nothing else the file names."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(ENV, raising=False)
    _, marker = user_code(tmp_path)
    _, other = user_code(tmp_path, "other.py")
    data = case_naming("step", "code.py:one_arg")
    path = write(tmp_path, {**data, "loss": "other.py:anything"})
    assert main(["check", "--case", str(path), "--step", "./code.py:one_arg"]) == 2
    err = capsys.readouterr().err
    assert "loss: 'other.py:anything'" in err and "step:" not in err.split(REFUSED)[1]
    assert not marker.exists() and not other.exists()
    path = write(tmp_path, data)
    _allowed_and_imported(["--case", str(path), "--step", "./code.py:one_arg"], marker, capsys)


def test_pyproject_file_patterns_allow_files_under_its_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(ENV, raising=False)
    (tmp_path / "models").mkdir()
    _, marker = user_code(tmp_path / "models")
    _, elsewhere = user_code(tmp_path, "top.py")
    (tmp_path / "pyproject.toml").write_text('[tool.fsdp-verify]\ntrusted = ["models/*.py"]\n')
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path / "sub")  # found from the current directory upward
    path = write(tmp_path, case_naming("step", "../top.py:one_arg"))
    assert main(["check", "--case", str(path)]) == 2
    err = capsys.readouterr().err
    assert REFUSED in err and 'trusted = ["top.py"]' in err and str(tmp_path / "pyproject.toml") in err
    assert not elsewhere.exists()
    path = write(tmp_path, case_naming("step", "../models/code.py:one_arg"))
    _allowed_and_imported(["--case", str(path)], marker, capsys)


def test_pyproject_module_patterns_allow_modules(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(ENV, raising=False)
    package = tmp_path / "trustpkg_e1"
    package.mkdir()
    (package / "__init__.py").write_text("")
    _, marker = user_code(package, "steps.py")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = write(tmp_path, case_naming("step", "trustpkg_e1.steps:one_arg"))
    (tmp_path / "pyproject.toml").write_text('[tool.fsdp-verify]\ntrusted = ["otherpkg.*"]\n')
    assert main(["check", "--case", str(path)]) == 2
    assert 'trusted = ["trustpkg_e1.steps"]' in capsys.readouterr().err and not marker.exists()
    (tmp_path / "pyproject.toml").write_text('[tool.fsdp-verify]\ntrusted = ["trustpkg_e1.*"]\n')
    _allowed_and_imported(["--case", str(path)], marker, capsys)


def test_a_bad_allow_list_is_bad_input_naming_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(ENV, raising=False)
    (tmp_path / "pyproject.toml").write_text('[tool.fsdp-verify]\ntrusted = "models/*.py"\n')
    path = write(tmp_path, case_naming("step", "code.py:one_arg"))
    assert main(["check", "--case", str(path)]) == 2
    assert "[tool.fsdp-verify] trusted: expected a list of module or file patterns" in capsys.readouterr().err


def test_the_toolkits_own_names_need_no_trust(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(ENV, raising=False)
    data = case_naming("model.factory", "fsdp_verify.models.hf:tiny_llama")
    data["engine"] = "fsdp_verify.zoo.mutants:grads_divided_twice"
    data["model"]["kwargs"] = {}
    case = Case.load(write(tmp_path, data))
    assert case.engine == data["engine"] and case.model.factory == "fsdp_verify.models.hf:tiny_llama"


@pytest.mark.parametrize(
    ("field", "name"),
    [
        ("model.factory", "fsdp_verify.sharded.pool:subprocess.run"),  # reached through an attribute
        ("model.factory", "fsdp_verify.imports:import_where"),  # imports what its kwargs name
        ("model.factory", "fsdp_verify.engines:resolve_engine"),  # the same
        ("engine", "fsdp_verify.engines:import_where"),  # the toolkit imported it; imports by name
        ("model.factory", "fsdp_verify_evil:make"),  # a prefix, not the toolkit
    ],
)
def test_toolkit_names_that_would_run_other_code_are_refused(field, name):
    with pytest.raises(CaseError, match=REFUSED):
        refuse_untrusted(case_naming(field, name), "case.json")


def test_case_load_refuses_by_default_and_trust_code_allows(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(ENV, raising=False)
    _, marker = user_code(tmp_path)
    path = write(tmp_path, case_naming("step", "code.py:one_arg"))
    with pytest.raises(CaseError, match=REFUSED):
        Case.load(path)
    assert not marker.exists()
    with pytest.raises(CaseError, match="step: expected a callable"):
        Case.load(path, trust_code=True)
    assert marker.exists()


# ---- end to end, the real CLI in fresh processes ----------------------------------------------
def cli(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != ENV}
    return launch.run(
        [sys.executable, "-m", "fsdp_verify", *args],
        cwd=cwd,
        env={**environ, **(env or {})},
        timeout=600,
    )


def test_a_case_whose_factory_is_a_shell_command_runs_nothing(tmp_path):
    """The case that ran `touch PWNED` through `subprocess:run` before the guard."""
    data = {
        "model": {"kind": "custom", "factory": "subprocess:run", "kwargs": {"args": "touch PWNED", "shell": True}},
        "world_size": 1,
    }
    path = write(tmp_path, data)
    for args, code in ((["check", "--case", "case.json"], 2), (["repro", "case.json"], 125)):
        r = cli(*args, cwd=tmp_path)
        assert r.returncode == code, r.stdout + r.stderr
        assert "model.factory: 'subprocess:run'" in r.stderr and "--trust-code" in r.stderr
        assert not (tmp_path / "PWNED").exists()
    assert path.exists()


GOOD_ENGINE = "from fsdp_verify.engines.fsdp2 import fully_shard_engine as shard\n"
BROKEN_ENGINE = """from fsdp_verify.zoo.mutants import grads_divided_twice


def shard(model, mesh, spec):
    return grads_divided_twice(model, mesh, spec)
"""


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_readme_bisect_recipe_with_trust_code_on_a_case_naming_the_engine(tmp_path):
    """docs/repro-and-bisect.md: a saved case that names the repository's engine
    itself is refused without --trust-code (exit 125, never "bad"), and bisects with it."""
    repo = tmp_path / "trainer"
    repo.mkdir()

    def git(*args: str) -> str:
        r = launch.run(["git", *args], cwd=repo, timeout=600)
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout

    git("init", "-q")
    for key, value in (("user.name", "Test"), ("user.email", "test@example.com"), ("commit.gpgsign", "false")):
        git("config", key, value)
    case = tmp_path / "case.json"
    mlp_case(2, steps=1, engine="engine.py:shard").save(case)
    revisions = []
    for message, text in (("good", GOOD_ENGINE), ("broken", BROKEN_ENGINE), ("later", BROKEN_ENGINE + "# x\n")):
        (repo / "engine.py").write_text(text)
        git("add", "-A")
        git("commit", "-q", "-m", message)
        revisions.append(git("rev-parse", "HEAD").strip())
    r = cli("repro", str(case), cwd=repo)
    assert r.returncode == 125 and "engine: 'engine.py:shard'" in r.stderr, r.stdout + r.stderr
    git("bisect", "start", revisions[2], revisions[0])
    r = launch.run(
        ["git", "bisect", "run", sys.executable, "-m", "fsdp_verify", "repro", str(case), "--trust-code"],
        cwd=repo,
        timeout=900,
    )
    git("bisect", "reset")
    assert f"{revisions[1]} is the first bad commit" in r.stdout, r.stdout + r.stderr
