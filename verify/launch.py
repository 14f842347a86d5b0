"""A command run to its end or ended, never left behind: every process it starts is found (its
descendants and its session), and on a timeout each Python one is asked for its stack first.

`PYTHONFAULTHANDLER=1` is set for the command, so a Python process sent SIGABRT prints every
thread's Python stack before it dies (faulthandler): what a hung rank was doing, in the error,
instead of a bare timeout. Then the whole tree is killed, torchrun's workers included (killing
torchrun alone left its worker alive, reparented to init, an hour and a half after a hung test).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

# What a timed-out command's error carries of its output: the stacks come last.
TAIL_CHARS = 12000


class LaunchTimeout(AssertionError):
    """A command that did not end in time; its message holds what each process was doing."""


def run(
    cmd: Sequence[str],
    timeout: float,
    env: dict | None = None,
    cwd: str | Path | None = None,
    input: str | None = None,
    merge_stderr: bool = False,
) -> subprocess.CompletedProcess:
    """`subprocess.run(cmd, capture_output=True, text=True)` bounded by `timeout` seconds: on
    expiry every process of the command is dumped and killed, and `LaunchTimeout` says which ran
    what. The command gets its own session, so that nothing of it survives the kill.
    `merge_stderr`: stderr into stdout, interleaved as a terminal shows them."""
    env = {**(os.environ if env is None else env), "PYTHONFAULTHANDLER": "1"}
    proc = subprocess.Popen(
        list(cmd),
        stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
        text=True,
        env=env,
        cwd=cwd,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(input, timeout=timeout)
    except subprocess.TimeoutExpired:
        tree = processes_of(proc.pid)
        described = "\n".join(f"  pid {pid}: {cmdline(pid)}" for pid in tree)
        end_all(tree, dump_first=True)
        out, err = _remaining_output(proc)
        said = (
            f"output (end, each Python process's stack after 'Fatal Python error: Aborted'):\n{out[-TAIL_CHARS:]}"
            if merge_stderr
            else f"stdout (end):\n{out[-TAIL_CHARS // 3 :]}\nstderr (end, each Python process's stack after"
            f" 'Fatal Python error: Aborted'):\n{err[-TAIL_CHARS:]}"
        )
        raise LaunchTimeout(
            f"{' '.join(map(str, cmd))}\nended after {timeout:.0f} s without finishing; its processes were:\n"
            f"{described}\n{said}"
        ) from None
    except BaseException:
        end_all(processes_of(proc.pid), dump_first=False)
        _remaining_output(proc)
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _remaining_output(proc: subprocess.Popen) -> tuple[str, str]:
    """What the ended command wrote; a process that escaped the kill and holds its pipes open
    (started in a session of its own) must not make this wait for ever."""
    try:
        out, err = proc.communicate(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        return "(the output could not be read: a process outside the command's tree holds its pipes)", ""
    return out or "", err or ""


def processes_of(root: int) -> list[int]:
    """`root`, its descendants and every other process of its session (a worker reparented to
    init once its launcher died keeps its session), root first."""
    parents: dict[int, int] = {}
    sessions: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            # the fields after the command name, which may hold spaces and parentheses
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            parents[int(entry.name)] = int(fields[1])
            sessions[int(entry.name)] = int(fields[3])
    found = [root]
    for pid in found:
        found += [child for child, parent in parents.items() if parent == pid and child not in found]
    found += [pid for pid, sid in sessions.items() if sid == root and pid not in found]
    return found


def cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "(gone)"
    return raw.replace(b"\0", b" ").decode(errors="replace").strip()[:200]


def end_all(pids: list[int], dump_first: bool) -> None:
    """When `dump_first`, each process prints its stacks in turn (faulthandler on SIGABRT): all are
    stopped first, so that none reacts to another's death (torchrun ends its other workers when
    one dies, before they could print), then each, children first, is aborted and resumed and
    waited for before the next, so that the stacks on the shared stderr do not interleave. Then
    SIGKILL whatever is left, children before their parents."""
    if dump_first:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGSTOP)
        deadline = time.monotonic() + 5.0
        for pid in reversed(pids):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGABRT)
                os.kill(pid, signal.SIGCONT)
            each = min(deadline, time.monotonic() + 2.0)
            while time.monotonic() < each and _alive(pid):
                time.sleep(0.02)
    for pid in reversed(pids):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
