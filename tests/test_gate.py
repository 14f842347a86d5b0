"""`fsdp-verify gate`: the same drawn cases under several environments, diffed record by record.

Installing a second torch release downloads gigabytes, so CI stands two interpreters in for two
releases (`--python NAME=PATH`, the gate's way to take an environment a user already has): this
venv's own, and the same interpreter behind a wrapper whose FSDP2 is broken, as a bad release's
would be (rank 1's first layer off by 1e-5). The nightly gates real releases (README)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_verify import launch
from tests.in_process import run_cli

ROOT = Path(__file__).resolve().parent.parent
SWEEP = "--models mlp --world-sizes 2 --precisions fp32 --steps 1"


def _gate(tmp_path: Path, *pythons: str, cases: int = 1) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "fsdp_verify", "gate", "--seed", "11", "--cases", str(cases)]
    cmd += ["--sweep-args", SWEEP, "--out", str(tmp_path / "gate")]
    for spec in pythons:
        cmd += ["--python", spec]
    return launch.run(cmd, cwd=ROOT, timeout=900)


def _broken_release(tmp_path: Path) -> Path:
    """An interpreter whose `--engine fsdp2` is a faulty FSDP2 (tests/engines/faulty.py)."""
    wrapper = tmp_path / "broken-python"
    faulty = ROOT / "tests" / "engines" / "faulty.py"
    wrapper.write_text(
        "#!/bin/sh\n"
        'for a in "$@"; do shift; [ "$a" = fsdp2 ] && a="'
        + f'{faulty}:rank1_activation_error"; set -- "$@" "$a"; done\n'
        f'exec {sys.executable} "$@"\n'
    )
    wrapper.chmod(0o755)
    return wrapper


def test_gate_names_a_case_that_fails_on_a_new_release_and_nothing_between_equal_ones(tmp_path):
    """One gate over three environments (a sweep each): the same interpreter twice, which must
    differ in nothing, and a broken one, whose failing case is named against the baseline."""
    done = _gate(tmp_path, f"good={sys.executable}", f"same={sys.executable}", f"broken={_broken_release(tmp_path)}")
    assert done.returncode == 1, done.stdout + done.stderr
    summary = json.loads((tmp_path / "gate" / "gate.json").read_text())
    assert summary["schema"] == "fsdp-verify/gate/1" and summary["baseline"] == "good"
    good, same, broken = summary["environments"]
    assert (good["cases"], good["failed"], broken["cases"], broken["failed"]) == (1, 0, 1, 1)
    assert (same["cases"], same["failed"]) == (1, 0)
    assert good["torch"] == broken["torch"]  # recorded from inside each environment
    new = summary["diffs"]["broken"]["places"]["."]["new_failures"]
    assert len(new) == 1 and new[0]["status"] != "pass", new
    assert not summary["diffs"]["same"]["places"]["."]["new_failures"], summary["diffs"]["same"]
    assert "== good -> same ==\nno change between" in done.stdout, done.stdout
    assert "NEW CAUSE [1 case]" in done.stdout and "| broken |" in done.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--python", f"only={sys.executable}"], "at least two environments"),
        (["--python", "nonsense", "--python", f"b={sys.executable}"], "expected NAME=PATH"),
        (["--python", "a=/no/such/python", "--python", f"b={sys.executable}"], "does not exist"),
        (["--torch", "latest", "--python", f"b={sys.executable}"], "expected a release such as 2.12.0"),
        (["--python", f"a={sys.executable}", "--python", f"a={sys.executable}"], "names must differ"),
    ],
)
def test_gate_refuses_bad_input_with_exit_2(tmp_path, args, message):
    done = run_cli(
        ["gate", *args, "--out", str(tmp_path / "g")],
        cwd=ROOT,
        env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")},
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert message in done.stderr
