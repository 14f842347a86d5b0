"""The release: the version comes from the package metadata (pyproject.toml alone), the changelog
has an entry for it, and CI tries the built wheel (.ci/wheel)."""

from __future__ import annotations

import importlib.metadata
import re
import sys
from pathlib import Path

import tomllib

import fsdp_verify
from fsdp_verify import launch

ROOT = Path(__file__).resolve().parents[1]


def test_version_is_the_package_metadata():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert fsdp_verify.__version__ == importlib.metadata.version("fsdp-verify") == declared
    out = launch.run([str(Path(sys.executable).parent / "fsdp-verify"), "--version"], timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == f"fsdp-verify {declared}", out


def test_the_changelog_has_this_version():
    text = (ROOT / "CHANGELOG.md").read_text()
    versions = re.findall(r"^## \[([^\]]+)\]", text, re.M)
    assert versions[0] == "Unreleased"
    assert versions[1] == fsdp_verify.__version__, versions
    assert all(re.match(r"\d+\.\d+\.\d+$", v) for v in versions[1:]), versions
    assert re.search(rf"^## \[{re.escape(versions[1])}\] - \d{{4}}-\d{{2}}-\d{{2}}$", text, re.M)


def test_the_wheel_check_installs_the_wheel_not_the_checkout():
    """.ci/wheel: the sdist and wheel built, the wheel installed without -e in a fresh venv, check
    EQUIVALENT and a plugin test from outside the checkout, fsdp_verify imported from that venv."""
    text = (ROOT / ".ci" / "wheel").read_text()
    assert "python -m build --outdir" in text
    install = next(ln for ln in text.splitlines() if "pip install" in ln)
    assert '"$wheel"' in install and " -e " not in install
    assert 'cd "$work/try"' in text  # outside the checkout
    assert "fsdp_verify.__file__.startswith(sys.argv[1])" in text
    assert 'fsdp-verify" check' in text and "grep -q '^EQUIVALENT: '" in text
    assert "-m pytest" in text and "fsdp_property" in text
