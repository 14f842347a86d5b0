"""The workflows a team copies (.github/workflows/pr.yml, gpu.yml) and CI's own script (.ci/run):
the YAML loads, they run the README's test command, and every command and option they name
exists. None has run on GitHub (docs/workflows.md says so); this is what can be checked here."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from fsdp_verify import pytest_plugin
from tests.doc_examples import fences

ROOT = Path(__file__).resolve().parents[1]
WORKFLOWS = ROOT / ".github" / "workflows"


def _workflow(name: str) -> dict:
    data = yaml.safe_load((WORKFLOWS / name).read_text())
    data["on"] = data.pop(True, data.get("on"))  # YAML 1.1 reads the key `on` as true
    return data


def _runs(workflow: dict) -> list[str]:
    return [s["run"] for job in workflow["jobs"].values() for s in job["steps"] if "run" in s]


def readme_commands() -> tuple[str, str]:
    """The README's two set-up commands: the main job, then the tests."""
    bash = [body for _, info, body in fences((ROOT / "README.md").read_text()) if info == "bash"]
    return bash[0][0], bash[1][0]


def test_the_readme_starts_with_its_two_commands_unchanged():
    main, tests = readme_commands()
    assert main == (
        "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e . "
        "&& fsdp-verify check"
    )
    assert tests == (
        "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && "
        "pip install -e '.[dev,hf,accelerate,lightning]' && pip install --no-deps torchtitan==0.3.0 verl==0.9.1 && pytest -n auto"
    )
    text = (ROOT / "README.md").read_text()
    assert text.index(main) < text.index(tests) < text.index("## ")  # first, before any section


def test_ci_runs_the_readme_test_command_after_the_docs_and_the_wheel():
    """.ci/run is the README's test command step by step, with the documentation (warnings as
    errors) and the wheel check between the install and pytest."""
    script = [ln.strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines() if not ln.strip().startswith("#")]
    _, tests = readme_commands()
    steps = [s.strip() for s in tests.split("&&")]

    def at(text: str) -> int:
        return next(i for i, ln in enumerate(script) if text in ln)

    assert steps[0] == "python3 -m venv .venv" and at(steps[0]) < at("pip install -q torch==2.13.0")
    assert at("pip install -q torch==2.13.0") < at("pip install -q -e '.[dev,hf,accelerate,lightning]'")
    order = [
        at("pip install -q -e '.[dev,hf,accelerate,lightning]'"),
        at("pip install -q --no-deps torchtitan==0.3.0 verl==0.9.1"),
        at("mkdocs build --strict"),
        at("bash .ci/wheel"),
        at("pytest -n auto"),
    ]
    assert order == sorted(order), order


def test_the_pull_request_workflow_runs_the_readme_test_command():
    wf = _workflow("pr.yml")
    assert "pull_request" in wf["on"]
    runs = _runs(wf)
    _, tests = readme_commands()
    assert tests in runs
    text = "\n".join(runs)
    for step in ("ruff check .", "ruff format --check .", "mkdocs build --strict", "bash .ci/wheel"):
        assert step in text, step
    assert (ROOT / ".ci" / "wheel").exists() and (ROOT / "mkdocs.yml").exists()
    torch_first = runs.index(next(r for r in runs if "download.pytorch.org/whl/cpu" in r))
    assert torch_first < runs.index(tests)  # the CPU build, before the README's pin resolves torch


def _plugin_options() -> set[str]:
    """The options the pytest plugin registers: the names its pytest_addoption passes to addoption."""
    import ast

    tree = ast.parse(Path(pytest_plugin.__file__).read_text())
    return {
        arg.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "addoption"
        for arg in node.args
        if isinstance(arg, ast.Constant) and str(arg.value).startswith("--")
    }


def _pytest_options(run: str) -> list[str]:
    text = run.replace("\\\n", " ")
    words = []
    for line in text.splitlines():
        if re.search(r"(^|\s)pytest\s", line):
            words += shlex.split(line.split("pytest", 1)[1])
    return [w.split("=")[0] for w in words if w.startswith("--")]


def test_the_gpu_job_runs_the_plugin_on_slices_of_the_gpus():
    wf = _workflow("gpu.yml")
    (job,) = wf["jobs"].values()
    assert "self-hosted" in job["runs-on"]
    text = "\n".join(_runs(wf))
    assert re.search(r"pip install -q torch --index-url \"https://download.pytorch.org/whl/\$CUDA\"", text)
    assert "torch.cuda.is_available()" in text  # a runner without CUDA fails, not passes on CPU
    assert "PYTEST_XDIST_AUTO_NUM_WORKERS" in text and "pytest -n auto" in text
    options = _pytest_options(text)
    assert {"--fsdp-world-sizes", "--fsdp-max-examples"} <= set(options)
    assert set(options) <= _plugin_options(), set(options) - _plugin_options()
    target = re.search(r"pytest -n auto (\S+)", text).group(1)
    assert (ROOT / target).exists(), target


def test_the_option_reader_sees_an_unknown_option():
    assert {"--fsdp-engine", "--fsdp-world-sizes", "--fsdp-repro-dir"} <= _plugin_options()
    assert _pytest_options("pytest -n auto x.py --fsdp-wrold-sizes 2") == ["--fsdp-wrold-sizes"]
    assert "--fsdp-wrold-sizes" not in _plugin_options()


@pytest.mark.parametrize("name", ["pr.yml", "gpu.yml", "nightly.yml"])
def test_every_job_has_a_timeout_and_checks_out(name):
    for job_name, job in _workflow(name)["jobs"].items():
        assert "timeout-minutes" in job or job_name == "merge-and-diff", job_name
        assert job["steps"][0].get("uses", "").startswith("actions/checkout@"), job_name
