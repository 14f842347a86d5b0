"""fsdp_verify.launch: a command that hangs is ended with what each of its processes was doing,
and nothing of it is left behind (issue 48: a test's timeout ended torchrun, not its worker,
which lived on reparented to init)."""

from __future__ import annotations

import sys
import time

import pytest

from fsdp_verify.launch import LaunchTimeout, run

CHILD = "import time\ndef waiting_in_the_child():\n    time.sleep(600)\nwaiting_in_the_child()"
# The command starts a child (which inherits its pipes), writes the child's pid, then either waits
# in a thread of its own or exits at once, leaving the child reparented to init (torchrun's case).
HANGS = r"""
import subprocess, sys, threading, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]])
with open(sys.argv[2], "w") as f:
    f.write(str(child.pid))
if sys.argv[3] == "wait":
    def waiting_in_a_thread():
        time.sleep(600)
    threading.Thread(target=waiting_in_a_thread, daemon=True).start()
    time.sleep(600)
"""


@pytest.mark.parametrize("parent", ["wait", "exit"])
def test_a_hung_command_is_ended_with_each_process_stack_and_nothing_left(tmp_path, parent):
    pid_file = tmp_path / "child.pid"
    started = time.monotonic()
    with pytest.raises(LaunchTimeout) as caught:
        run([sys.executable, "-c", HANGS, CHILD, str(pid_file), parent], timeout=3)
    said = str(caught.value)
    assert time.monotonic() - started < 20
    assert "ended after 3 s without finishing" in said
    assert "Fatal Python error: Aborted" in said  # faulthandler's dump, one per Python process
    assert " in waiting_in_the_child" in said, said  # a stack's line, not the command's text
    assert (" in waiting_in_a_thread" in said) == (parent == "wait"), said
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.05)
    assert not _alive(child), "the child outlived its command"


def test_a_command_that_ends_gives_its_output_and_exit_status():
    done = run(
        [sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"], timeout=60
    )
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")
    both = "import sys; print('a', flush=True); print('b', file=sys.stderr)"
    assert run([sys.executable, "-c", both], timeout=60, merge_stderr=True).stdout == "a\nb\n"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
