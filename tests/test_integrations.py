"""The integrations are imported lazily: fsdp_verify and fsdp_verify.integrations import no
training library, and a missing one is named with the extra that brings it."""

from __future__ import annotations

import sys

import pytest

from fsdp_verify import launch
from fsdp_verify.integrations import require
from tests.recorded_runs import ENV, ROOT


def test_importing_the_package_imports_no_training_library():
    code = (
        "import sys, fsdp_verify, fsdp_verify.integrations, fsdp_verify.recorder, fsdp_verify.commands.cli;"
        "print(sorted(m for m in ('transformers', 'accelerate', 'lightning') if m in sys.modules))"
    )
    r = launch.run([sys.executable, "-c", code], env=ENV, cwd=ROOT, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_a_missing_library_names_its_extra():
    with pytest.raises(ImportError, match=r"no_such_library is not installed: pip install 'fsdp-verify\[lightning\]'"):
        require("no_such_library", "lightning")
