"""Library warnings tallied, not printed (verify/library_warnings.py): each once with how many
times it was issued, in the ranks and in the command; filters that ignore or raise still do;
a sweep writes them to report.json and says one line, while what is no warning (a line a
library writes, a crashing rank's last words) still reaches the terminal."""

from __future__ import annotations

import logging
import warnings

import pytest

from fsdp_verify.commands.cli import main
from fsdp_verify.library_warnings import Tally, collecting, location
from fsdp_verify.reports.schema import load
from tests.conftest import mlp_case
from tests.engines.noisy import LAST_WORDS, LINE, LOGGED, LOGGED_ERROR, LOGGER, WARNING, warns_and_writes

NOISY = "tests/engines/noisy.py:"
CHEAP = ["--world-sizes", "2", "--models", "mlp", "--precisions", "fp32", "--pin", "steps=1", "--no-progress"]


def _warn(n: int, message: str = "a library warning") -> None:
    for _ in range(n):
        warnings.warn(message, UserWarning, stacklevel=1)  # one place: Python would show it once


def test_a_warning_issued_many_times_from_one_place_is_one_entry_with_its_count():
    with collecting() as tally:
        _warn(3)
        _warn(2, "another")
    (first, second) = tally.entries()
    assert (first["category"], first["message"], first["count"]) == ("UserWarning", "a library warning", 3)
    assert second["message"] == "another" and second["count"] == 2
    assert first["location"] == second["location"] and first["location"].endswith(
        f"test_library_warnings.py:{_warn.__code__.co_firstlineno + 2}"
    )
    assert tally.line() == "5 library warnings (2 distinct): see report.json"
    assert Tally().line() is None  # none: no line


def test_filters_that_ignore_or_raise_still_do_and_the_old_handler_comes_back():
    before = warnings.showwarning
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="ignored")
        warnings.filterwarnings("error", message="raised")
        with collecting() as tally:
            _warn(2, "ignored")
            with pytest.raises(UserWarning, match="raised"):
                _warn(1, "raised")
    assert tally.entries() == [] and warnings.showwarning is before


def test_a_librarys_log_warning_is_tallied_and_its_errors_still_said(capsys):
    log = logging.getLogger("some.library")
    handler = logging.StreamHandler()  # stderr, as a library's own handler
    log.addHandler(handler)
    try:
        with collecting() as tally:
            for _ in range(2):
                log.warning("slow path taken: %d all-reduces", 2)
            log.error("a real error")
        log.warning("after the block: said")
    finally:
        log.removeHandler(handler)
    (((category, message, _), count),) = tally.counts.items()
    assert (category, message, count) == ("log:some.library", "slow path taken: 2 all-reduces", 2)
    err = capsys.readouterr().err
    assert "a real error" in err and "after the block: said" in err and "slow path" not in err


def test_a_package_file_is_located_from_its_package_folder():
    assert location("/venv/lib/python3.11/site-packages/torch/distributed/x.py", 7) == "torch/distributed/x.py:7"
    assert location("/work/tests/engines/noisy.py", 3) == "/work/tests/engines/noisy.py:3"


def test_outside_a_command_a_ranks_warning_is_issued_here(fsdp_check, caplog):
    """check_case in pytest (no command collecting): the ranks' warnings reach this process's
    warnings machinery (pytest's summary, `pytest.warns`), not the ranks' stderr."""
    with pytest.warns(UserWarning, match=WARNING):
        verdict = fsdp_check(mlp_case(2, engine=NOISY + "warns_and_writes", steps=1))
    assert verdict.ok
    assert [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING] == [LOGGED]


def test_a_sweep_tallies_its_ranks_warnings_and_says_one_line(tmp_path, capfd):
    """2 cases of 2 ranks, a shard each: the engine's warning twice a shard, in report.json, one
    terminal line; the line it writes that is no warning still reaches stderr. Merged: 4."""
    args = ["sweep", "--cases", "2", "--seed", "3", "--engine", NOISY + "warns_and_writes", *CHEAP]
    for i in (1, 2):
        assert main([*args, "--shard", f"{i}/2", "--out", str(tmp_path / f"s{i}")]) == 0
        out, err = capfd.readouterr()
        assert WARNING not in err and WARNING not in out and err.count(LINE) == 2
        assert LOGGED not in err and err.count(LOGGED_ERROR) == 2  # an error is said, by each rank
        warned = load(tmp_path / f"s{i}")["warnings"]
        (ours,) = [w for w in warned if w["message"] == WARNING]
        assert ours["count"] == 2 and ours["category"] == "UserWarning"
        assert ours["location"].endswith(f"noisy.py:{warns_and_writes.__code__.co_firstlineno + 1}")
        (logged,) = [w for w in warned if w["message"] == LOGGED]
        assert logged["count"] == 2 and logged["category"] == f"log:{LOGGER}"
        n = sum(w["count"] for w in warned)
        assert f"\n{n} library warning{'' if n == 1 else 's'} ({len(warned)} distinct): see report.json\n" in out
    assert main(["report", "merge", str(tmp_path / "s1"), str(tmp_path / "s2"), "--out", str(tmp_path / "m")]) == 0
    merged = load(tmp_path / "m")["warnings"]
    assert [w["count"] for w in merged if w["message"] == WARNING] == [4]
    assert "library warnings (" in capfd.readouterr().out  # merge's summary says it too


def test_a_crashing_ranks_last_words_still_reach_the_terminal(tmp_path, capfd):
    args = ["sweep", "--cases", "1", "--seed", "3", "--engine", NOISY + "warns_then_crashes", *CHEAP]
    assert main([*args, "--out", str(tmp_path)]) == 1
    out, err = capfd.readouterr()
    assert LAST_WORDS in err and "a rank crashed" in out
    # rank 1 died before replying (its warning is lost with it); rank 0's comes with its error reply, if any
    assert all(w["message"] != WARNING or w["count"] <= 1 for w in load(tmp_path)["warnings"])


def test_what_a_library_says_as_the_zygote_imports_it_stays_off_the_terminal():
    """The zygote imports the model libraries its pool's process has loaded (verify/sharded/zygote.py
    `_warm`); what one logs or warns as it imports (torchao's CUDA kernels a CPU cannot load,
    Dynamo's notes) would reach the terminal from there, past the report. A fresh process, so that
    the library (one that logs and warns as it is imported) is imported for the first time there."""
    import subprocess
    import sys

    code = (
        "import logging, warnings\n"
        "from fsdp_verify.sharded.zygote import _warm\n"
        "log = logging.getLogger('a_library')\n"
        "import importlib.abc, importlib.util, sys\n"
        "class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        return importlib.util.spec_from_loader(name, self) if name == 'loud_library' else None\n"
        "    def create_module(self, spec):\n"
        "        return None\n"
        "    def exec_module(self, module):\n"
        "        log.warning('Failed to load a kernel')\n"
        "        warnings.warn('a note at import')\n"
        "sys.meta_path.insert(0, Finder())\n"
        "_warm(['loud_library'])\n"
        "assert 'loud_library' in sys.modules\n"
        "print('imported')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "imported" in done.stdout, done.stderr
    assert "Failed to load a kernel" not in done.stderr and "a note at import" not in done.stderr, done.stderr
