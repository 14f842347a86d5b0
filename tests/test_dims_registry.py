"""The dimension registry (verify/dims/registry.py): a dimension written outside the toolkit
(tests/dims_example/) plugs in by one registration, and its flag, Case field, engine step,
reference conversion and knob all work with no file of the toolkit edited; a case file naming a
package that is not registered is refused, its code never imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_verify.case import Case
from fsdp_verify.validation import CaseError

ROOT = Path(__file__).resolve().parent.parent


def _check(tmp_path, *flags: str) -> tuple[int, str, dict]:
    out = tmp_path / "verdict.json"
    env = {**os.environ, "FSDP_VERIFY_DIMS": "tests.dims_example", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "fsdp_verify", "check", "--model", "mlp", "--scale-init", "2", *flags]
    run = subprocess.run([*cmd, "--json", str(out)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    return run.returncode, run.stdout + run.stderr, json.loads(out.read_text()) if out.exists() else {}


def test_a_dimension_from_outside_plugs_in_by_one_registration(tmp_path):
    rc, text, verdict = _check(tmp_path)
    assert rc == 0, text
    assert verdict["case"]["dims"] == {"scale_init": {"factor": 2}}
    rc, text, verdict = _check(tmp_path, "--engine", "tests.dims_example.mutants:wrong_factor")
    assert rc == 1, text
    assert verdict["first_divergence"]["phase"] == "init", verdict["first_divergence"]


def test_a_case_file_naming_a_package_not_registered_is_refused_unread():
    with pytest.raises(CaseError, match=r"^dims\.scale_init: expected one of the dimension packages"):
        Case.from_dict({"dims": {"scale_init": {"factor": 2}}})
    assert "tests.dims_example" not in sys.modules
