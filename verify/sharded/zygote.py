"""Rank processes forked from a warm parent, so that restarting a pool costs a fork, not a start
of torch.

A pool restarts its ranks after every rank failure (the process group is unusable then). A new
process spends seconds importing torch and the toolkit (5-9 s each on a loaded 2-core machine,
measured for issue 38) before it can join a process group, and a search shrinking a case that
crashes a rank restarts the pool once per step. The zygote is one process (for all the pools of
a process, below) that imports all that once and then forks each rank on request: the fork is
milliseconds. It imports but never runs torch (no CUDA, no thread pools), which is what makes the
fork safe, and it sets the rank's own environment (its GPUs) before anything in the rank touches
CUDA.

One zygote serves every pool of a process whose import environment is the same (`shared`: a
sweep over world sizes 1-4 has four pools, and started four zygotes, each importing torch and
Dynamo, 3-4 s of CPU, before): the ranks take their pool's environment when forked anyway. It
stops when the last pool using it closes.

The ranks are the zygote's children, so the zygote reaps them and sends their exit codes back;
`RankProcess` is the pool's handle on one (the subset of `subprocess.Popen` the pool uses). The
zygote dies with the pool's process (PR_SET_PDEATHSIG, and the end of its pipe), and its ranks
die with it. Ctrl-C is the pool's owner's to handle: the zygote ignores it, as the ranks do.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import recvfds, sendfds

# What the zygote imports for its ranks: what a rank imports (torch, the loop, the engines), and
# what FSDP2's first `fully_shard` in a process imports lazily (torch._dynamo: 3.4 s, measured).
# Importing starts no thread and no CUDA, so forking after it is safe.
WARM = ("fsdp_verify.sharded.worker", "torch._dynamo")
# Libraries that define models (a case's `hf:` model, torchtitan's, torchao's float8 layers), which a
# rank imports after its fork, 1.4-1.9 s each (measured): the modules of them the pool's own process
# has loaded (its reference built one) go with each spawn request, and the zygote imports those it
# lacks before forking, so every rank forked later has them (a sweep's pools of several world sizes,
# a pool started again after a failure). Importing them starts no thread (checked before a fork).
WARM_WHEN_LOADED = ("transformers", "torchtitan", "torchao")


def loaded_model_libraries() -> list[str]:
    """The modules of WARM_WHEN_LOADED this process has imported, in import order."""
    return [m for m in list(sys.modules) if m.split(".", 1)[0] in WARM_WHEN_LOADED]


class ZygoteError(RuntimeError):
    """The zygote died or did not answer (the pool then reports its ranks as failing to start)."""


# Variables read when torch and the toolkit are imported (not only when a rank runs): a zygote
# started under other values of these is another zygote.
IMPORT_TIME_PREFIXES = ("TORCH", "PYTORCH", "FSDP_VERIFY", "OMP_", "MKL_", "KMP_", "PYTHON")
# Read when used, from the rank's own environment: Inductor's cache directory, which a first
# compile in the parent sets (verify/training/compile.py `use_cache_dir`).
READ_WHEN_USED = frozenset({"TORCHINDUCTOR_CACHE_DIR"})
# What a forked rank inherits from the zygote's start besides its environment.
INHERITED_LIMITS = ("RLIMIT_FSIZE", "RLIMIT_AS", "RLIMIT_NOFILE", "RLIMIT_DATA", "RLIMIT_STACK")

_SHARED: dict[tuple, Zygote] = {}
_SHARED_LOCK = threading.Lock()


def shared(env: dict[str, str], start_timeout_s: float = 300.0) -> Zygote:
    """The process's zygote for `env`'s import environment (its PYTHONPATH and the variables of
    IMPORT_TIME_PREFIXES) and this process's resource limits now (which the zygote, and so its
    ranks, inherit), made on first use; every caller gives it back with `release`."""
    import resource

    limits = tuple(resource.getrlimit(getattr(resource, name)) for name in INHERITED_LIMITS)
    variables = sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_TIME_PREFIXES))
    key = (tuple(kv for kv in variables if kv[0] not in READ_WHEN_USED), limits)
    with _SHARED_LOCK:
        zygote = _SHARED.get(key)
        if zygote is None:
            zygote = _SHARED[key] = Zygote(env, start_timeout_s)
            zygote._key = key
        zygote._users += 1
        return zygote


def release(zygote: Zygote) -> None:
    """One user fewer; the last one stops it (and any rank of it still running)."""
    with _SHARED_LOCK:
        if zygote._users <= 0:
            raise RuntimeError("zygote released more times than it was taken")
        zygote._users -= 1
        if zygote._users > 0:
            return
        if _SHARED.get(zygote._key) is zygote:
            del _SHARED[zygote._key]
    zygote.close()


class Zygote:
    """The pool's side: start the zygote, fork ranks from it, learn how they ended. Its methods
    may be called from several threads (pools of one process, each its own thread): one talks
    to the zygote at a time. The zygote dies with the thread that started it (PR_SET_PDEATHSIG
    follows the forking thread), so pools are best started from the main thread; if it dies,
    every rank it forked is reported killed, and the next spawn starts another."""

    def __init__(self, env: dict[str, str], start_timeout_s: float = 300.0):
        self._lock = threading.RLock()
        self._live: set[int] = set()  # ranks forked and not yet reported ended
        self._users = 0
        self._key: tuple = ()
        self._sock: socket.socket | None = None
        self._conn: Connection | None = None
        self._proc: subprocess.Popen | None = None
        self.exits: dict[int, int] = {}  # pid -> exit code (negative: killed by that signal)
        self._env = env
        self._start_timeout_s = start_timeout_s

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        with self._lock:
            self._start()

    def _start(self) -> None:
        ours, theirs = socket.socketpair()
        cmd = [sys.executable, "-m", "fsdp_verify.sharded.zygote", str(theirs.fileno())]
        self._proc = subprocess.Popen(cmd, pass_fds=(theirs.fileno(),), env=self._env, stdin=subprocess.DEVNULL)
        theirs.close()
        self._sock, self._conn = ours, Connection(os.dup(ours.fileno()))
        self._expect("ready", self._start_timeout_s)

    def close(self) -> None:
        """Stop the zygote; ranks still running die with it (their PR_SET_PDEATHSIG)."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        self._all_killed()  # every rank dies with the zygote (its PR_SET_PDEATHSIG)
        if self._conn is not None:
            with contextlib.suppress(OSError, ValueError):
                self._conn.send(("stop",))
            self._conn.close()
            self._sock.close()
        if self._proc is not None:
            try:
                self._proc.wait(5.0)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(5.0)
        self._sock = self._conn = self._proc = None

    def spawn(self, args: list[str], fds: tuple[int, int, int], env: dict[str, str]) -> RankProcess:
        """Fork a rank running `worker.main(args)` with the pipe ends `fds` (down, up, and the
        write end its stderr goes to), its environment `env` (its PYTHONPATH put first on its
        sys.path)."""
        with self._lock:
            if not self.alive:
                self.close()
                self.start()
            try:
                # the caller's working directory now: another pool may have started the zygote
                # elsewhere, and a rank resolves relative paths (an engine's file) against its own
                self._conn.send(("spawn", args, env, os.getcwd(), loaded_model_libraries()))
                sendfds(self._sock, list(fds))
            except OSError as e:
                raise ZygoteError(f"the zygote is gone: {e}") from None
            pid = self._expect("pid", 120.0)  # after the zygote's imports of what it lacked (seconds)
            self.exits.pop(pid, None)  # an earlier rank's with the same pid (its exit came first)
            self._live.add(pid)
            return RankProcess(self, pid)

    def kill(self, pid: int) -> None:
        with self._lock, contextlib.suppress(OSError, ValueError, AttributeError):
            self._conn.send(("kill", pid))

    def pump(self, timeout_s: float) -> None:
        """Read what the zygote sent (exit codes) for up to `timeout_s` (0: what is there). Another
        thread talking to the zygote meanwhile: what it reads lands in `exits` all the same."""
        deadline = time.monotonic() + max(timeout_s, 0.0)
        if not (self._lock.acquire(timeout=timeout_s) if timeout_s > 0 else self._lock.acquire(blocking=False)):
            return
        try:
            if self._conn is None:
                self._all_killed()
                raise ZygoteError("the zygote is gone")
            if wait([self._conn], timeout=max(deadline - time.monotonic(), 0.0)):
                self._read()
        finally:
            self._lock.release()

    def _all_killed(self) -> None:
        """Every rank not yet reported ended, as killed (they die with the zygote)."""
        for pid in self._live:
            self.exits.setdefault(pid, -signal.SIGKILL)
        self._live.clear()

    def _read(self) -> tuple:
        try:
            message = self._conn.recv()
        except (EOFError, OSError):
            self._conn.close()
            self._sock.close()
            self._sock = self._conn = None
            self._all_killed()
            raise ZygoteError("the zygote died") from None
        if message[0] == "exit":
            self.exits[message[1]] = message[2]
            self._live.discard(message[1])
        return message

    def _expect(self, kind: str, timeout_s: float):
        import time

        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not wait([self._conn], timeout=remaining):
                raise ZygoteError(f"no {kind!r} from the zygote within {timeout_s:.0f} s")
            message = self._read()
            if message[0] == kind:
                return message[1] if len(message) > 1 else None


class RankProcess:
    """One rank forked by the zygote, as the pool uses a `subprocess.Popen`."""

    def __init__(self, zygote: Zygote, pid: int):
        self.zygote, self.pid = zygote, pid

    @property
    def returncode(self) -> int | None:
        return self.zygote.exits.get(self.pid)

    def poll(self) -> int | None:
        if self.returncode is None:
            with contextlib.suppress(ZygoteError):
                self.zygote.pump(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            remaining = 1.0 if deadline is None else deadline - time.monotonic()
            if remaining <= 0:
                raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout)
            try:
                self.zygote.pump(remaining)
            except ZygoteError:  # the zygote died and took its ranks with it
                self.zygote.exits.setdefault(self.pid, -signal.SIGKILL)
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            self.zygote.kill(self.pid)


# ---- the zygote process -----------------------------------------------------------------------
def _rank(args: list[str], fds: list[int], env: dict[str, str], cwd: str, handles: list) -> None:
    """In the forked child: drop the zygote's handles, take the rank's environment and working
    directory, run the rank."""
    code = 1
    try:
        for handle in handles:
            handle.close() if hasattr(handle, "close") else os.close(handle)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        # The pool's environment and import path now, not the zygote's at its start: a rank
        # sees what a process started now would (a variable set, a path added since).
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        sys.path[:0] = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
        os.dup2(fds[2], 2)  # its stderr: the pool relays it and keeps its tail (pool.py)
        os.close(fds[2])
        from fsdp_verify.sharded import worker

        worker.main([*args[:3], str(fds[0]), str(fds[1]), args[3]])
        code = 0
    finally:
        os._exit(code)


def _warm(libraries: list[str]) -> None:
    """Import the model libraries' modules the pool's process has and this zygote lacks (see
    WARM_WHEN_LOADED). One that fails to import is left to the rank (which then says why). Forking
    stays safe only single-threaded: an import that started a thread would be a bug here."""
    from fsdp_verify.library_warnings import collecting

    missing = [m for m in libraries if m not in sys.modules]
    if not missing:
        return
    # What they say as they import (torchao's CUDA kernels it cannot load on a CPU, Dynamo's
    # notes) would reach the terminal from here, past the report a rank's would go to: dropped.
    with collecting():
        for module in missing:
            with contextlib.suppress(Exception):
                importlib.import_module(module)
    if threading.active_count() != 1:
        raise RuntimeError(f"the zygote runs threads after importing {missing[:3]}...: forking is unsafe")
    gc.freeze()  # as after the first imports: out of the ranks' collections


def main(fd: int) -> None:
    # Dies with the pool's process (before the imports, which take seconds). No watcher thread, as
    # a rank has (worker.py): the zygote forks, so it stays one thread.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for module in WARM:
        importlib.import_module(module)
    # What was imported stays out of the ranks' garbage collections: a collection touches every
    # object it tracks, and so would copy every page the ranks share with the zygote (a polite
    # stop's gc.collect took 1.6 s, measured).
    gc.freeze()

    control = socket.socket(fileno=fd)
    conn = Connection(os.dup(fd))
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a rank ended: the wakeup fd says so
    children: set[int] = set()
    conn.send(("ready",))
    while True:
        ready = wait([conn, wake_r])
        if wake_r in ready:
            os.read(wake_r, 4096)
        while children:  # reap every rank that ended, and say how
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            children.discard(pid)
            conn.send(("exit", pid, os.waitstatus_to_exitcode(status)))
        if conn not in ready:
            continue
        try:
            message = conn.recv()
        except (EOFError, OSError):
            break
        if message[0] == "stop":
            break
        if message[0] == "kill":
            if message[1] in children:  # not reaped yet, so the pid is still this rank's
                os.kill(message[1], signal.SIGKILL)
            continue
        _, args, env, cwd, libraries = message
        fds = recvfds(control, 3)  # the rank's two pipe ends and its stderr
        _warm(libraries)
        pid = os.fork()
        if pid == 0:
            _rank(args, fds, env, cwd, [control, conn, wake_r, wake_w])
        for f in fds:
            os.close(f)
        children.add(pid)
        conn.send(("pid", pid))
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    os._exit(0)


if __name__ == "__main__":
    main(int(sys.argv[1]))
