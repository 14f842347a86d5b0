"""Ctrl-C in `fsdp-verify sweep` and `fuzz`: the CLI stops drawing, writes the report of the cases
that ran (valid against the schema, `interrupted`: true, on the page and the terminal too), exits
130, and leaves none of its pool's rank processes behind. Sent as a terminal sends it (to the whole
foreground process group, ranks included) and to the CLI process alone."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fsdp_verify.reports.schema import load
from tests.conftest import alive, descendants_of

ROOT = Path(__file__).resolve().parents[1]
# One-step MLPs at world size 2: cheap cases, and a pool of two ranks to leave behind.
CHEAP = ["--world-sizes", "2", "--models", "mlp", "--precisions", "fp32", "--pin", "steps=1"]
COMMANDS = {
    # a sweep draws all its cases first (200 took 2.2 s): 40, far more than run before the Ctrl-C
    "sweep": ["sweep", "--cases", "40", "--seed", "5", "--no-progress", *CHEAP],
    "fuzz": ["fuzz", "--max-examples", "200", "--profile", "ci", *CHEAP],  # progress bar on stderr
}


def cases_done(command: str, out: Path, stderr: Path) -> int:
    if command == "sweep":
        rows = out / "rows.jsonl"
        return len(rows.read_text().splitlines()) if rows.exists() else 0
    bars = re.findall(r"(\d+)/200", stderr.read_text(errors="replace"))  # tqdm: "fuzz: 1%|...| 2/200"
    return int(bars[-1]) if bars else 0


@pytest.mark.parametrize(
    ("command", "target"), [("sweep", "process"), ("sweep", "group"), ("fuzz", "process"), ("fuzz", "group")]
)
def test_ctrl_c_writes_the_report_of_what_ran_exits_130_and_leaves_no_rank(tmp_path, command, target):
    out, stdout, stderr = tmp_path / "out", tmp_path / "stdout", tmp_path / "stderr"
    cli = [sys.executable, "-m", "fsdp_verify", *COMMANDS[command], "--out", str(out)]
    with stdout.open("w") as o, stderr.open("w") as e:
        # As a shell starts a foreground job: SIGINT at its default. A test run started in the
        # background (`pytest ... &` in a script) ignores SIGINT, every child inherits that, and
        # a CLI that ignores Ctrl-C (as it must under nohup) would run to the end here.
        proc = subprocess.Popen(
            cli,
            stdout=o,
            stderr=e,
            start_new_session=True,
            cwd=tmp_path,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    try:
        deadline = time.monotonic() + 600  # torch and two ranks start slowly on a loaded machine
        while cases_done(command, out, stderr) < 2:
            assert proc.poll() is None, f"exited early ({proc.returncode}): {stderr.read_text()[-2000:]}"
            assert time.monotonic() < deadline, "no case finished in time"
            time.sleep(0.5)
        ranks = descendants_of(proc.pid)
        assert len(ranks) == 3, ranks  # the pool's zygote and its two ranks, the pids to find gone afterwards
        if target == "group":  # a terminal's Ctrl-C: the CLI and its ranks (same process group)
            os.killpg(proc.pid, signal.SIGINT)
        else:
            os.kill(proc.pid, signal.SIGINT)
        code = proc.wait(120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    err, text = stderr.read_text(errors="replace"), stdout.read_text()
    assert code == 130, f"exit {code}\n{text}\n{err[-3000:]}"
    assert "Traceback" not in err, err[-3000:]
    assert not [pid for pid in ranks if alive(pid)], "a rank outlived the interrupted command"
    report = load(out)  # validated against report.schema.json
    assert report["interrupted"] is True and report["kind"] == command
    assert 2 <= report["counts"]["cases"] < (40 if command == "sweep" else 200)
    if command == "sweep":  # the report holds exactly the rows streamed; rerunning resumes after them
        rows = [json.loads(line) for line in (out / "rows.jsonl").read_text().splitlines()]
        assert sorted(c["case_hash"] for c in report["cases"]) == sorted(r["case_hash"] for r in rows)
        assert "INTERRUPTED (Ctrl-C)" in text
    else:
        assert "Interrupted (Ctrl-C)" in text and f"--seed {report['seed']}" in text
    assert 'id="interrupted"' in (out / "report.html").read_text()


def test_a_ctrl_c_swallowed_where_it_landed_is_raised_at_the_next_check(capfd):
    """A KeyboardInterrupt raised inside a `__del__` or a gc callback (Hypothesis installs one) is
    swallowed by Python ("Exception ignored in ..."): a sweep met it and ran on to its end (exit 0,
    not 130). Remembered, it is raised at the sweep's next check between cases, and Python's
    traceback of the swallowed one is not printed (CI's fuzz met one there); any other exception
    swallowed in a `__del__` still is."""
    from fsdp_verify.commands.interrupt import noticing_interrupts, raise_if_interrupted

    class FailsWhileFreed:
        def __del__(self):
            raise ValueError("a user's own error while freed")

    class InterruptedWhileFreed:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)  # the handler runs here, inside __del__: its KeyboardInterrupt is ignored

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        seen = []
        hook = sys.unraisablehook
        sys.unraisablehook = seen.append  # pytest's own catches what reaches it; this one counts
        try:
            with noticing_interrupts():
                InterruptedWhileFreed()
                FailsWhileFreed()
                with pytest.raises(KeyboardInterrupt):
                    raise_if_interrupted()
        finally:
            sys.unraisablehook = hook
    finally:
        signal.signal(signal.SIGINT, previous)
    assert [type(info.exc_value) for info in seen] == [ValueError]
    assert "KeyboardInterrupt" not in capfd.readouterr().err


def test_fuzz_raises_a_swallowed_ctrl_c_after_the_case_it_landed_in(tmp_path, monkeypatch):
    """The same in `fuzz`: a Ctrl-C swallowed during a case (here: remembered as the handler would,
    after the first case) stops the search there, the report written, exit 130."""
    from fsdp_verify.commands import interrupt
    from fsdp_verify.commands.cli import main
    from fsdp_verify.properties import properties

    real = properties.check_case

    def interrupted_during(case, **kwargs):
        verdict = real(case, **kwargs)
        interrupt._interrupted.set()  # what the handler does before its KeyboardInterrupt is swallowed
        return verdict

    monkeypatch.setattr(properties, "check_case", interrupted_during)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        rc = main(
            ["fuzz", "--engine", "fsdp2", "--world-sizes", "1", "--max-examples", "20", "--seed", "7"]
            + ["--out", str(tmp_path), "--no-progress"]
        )
    finally:
        signal.signal(signal.SIGINT, previous)
    assert rc == 130
    report = load(tmp_path / "report.json")
    assert report["interrupted"] is True and report["examples"] == 1, report["examples"]


def test_a_ctrl_c_no_command_handles_exits_130_and_the_exit_cannot_be_cut_by_another(monkeypatch, capsys):
    """`check` and the other commands have no report to finish: Ctrl-C exits 130 without a
    traceback. After an interrupted command the process ignores SIGINT for its last instants
    (Python puts the default back as it shuts down: a late Ctrl-C made `sweep`'s 130 a -2 in CI)."""
    import fsdp_verify.commands.cli as cli
    from fsdp_verify.__main__ import entry

    def interrupted():
        raise KeyboardInterrupt

    before = signal.getsignal(signal.SIGINT)
    monkeypatch.setattr(sys, "argv", ["fsdp-verify", "check"])
    try:
        for main, code, ignored in ((interrupted, 130, True), (lambda: 130, 130, True), (lambda: 0, 0, False)):
            signal.signal(signal.SIGINT, signal.default_int_handler)  # as a shell's foreground job has it
            monkeypatch.setattr(cli, "main", main)
            assert entry() == code
            assert (signal.getsignal(signal.SIGINT) is signal.SIG_IGN) is ignored
        assert "fsdp-verify: interrupted (Ctrl-C)" in capsys.readouterr().err
    finally:
        signal.signal(signal.SIGINT, before)
