"""A pool of `world_size` long-lived rank processes that run case after case.

Starting torch costs seconds, a tiny case milliseconds, so workers stay alive. A case that
crashes a rank, raises, or hangs past its timeout ends in a `RankFailure` naming the rank and the
phase it was in; the pool then kills every worker (no process left behind) and starts afresh on
the next case. Each pool rendezvous through a FileStore in its own temp dir: no fixed ports and no
shared files, so pools of different pytest-xdist workers never meet.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path

from fsdp_verify.case import Case
from fsdp_verify.engines.routed_reduction import known_crash
from fsdp_verify.library_warnings import received
from fsdp_verify.sharded import zygote as zygotes
from fsdp_verify.sharded.arena import read_fill
from fsdp_verify.sharded.devices import pool_env
from fsdp_verify.sharded.worker import PhaseBoard
from fsdp_verify.sharded.zygote import RankProcess, Zygote, ZygoteError
from fsdp_verify.trace import Trace

DEFAULT_TIMEOUT_S = 120.0


@dataclass
class RankFailure(Exception):
    """A rank crashed, raised, or hung. `rank` is the one to blame, `phase` where it was."""

    kind: str  # "crash" | "error" | "hang" | "start"
    rank: int
    phase: str
    detail: str
    phases: dict[int, str] = field(default_factory=dict)

    def __str__(self) -> str:
        others = ", ".join(f"rank {r}: {p!r}" for r, p in sorted(self.phases.items()) if r != self.rank)
        tail = f" (others: {others})" if others else ""
        return f"rank {self.rank} {self.kind} in phase {self.phase!r}: {self.detail}{tail}"


class RankPool:
    def __init__(self, world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S, start_timeout_s: float = 300.0):
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.start_timeout_s = start_timeout_s
        self._procs: list[RankProcess] = []
        self._to: list[Connection] = []  # parent -> rank
        self._from: list[Connection] = []  # rank -> parent; EOF when the rank dies
        self._board: PhaseBoard | None = None
        self._case: Case | None = None  # the case submitted last
        self._dir: Path | None = None
        self.starts = 0  # how many times processes were spawned (1 = never recovered)
        # Seconds per kind of phase of the last case: rank 0's (verify/sharded/worker.py PhaseClock)
        # and this side's ("decode trace").
        self.last_profile: dict[str, float] = {}
        # How rank 0's last trace came: "arena" (a file in the pool's memory directory,
        # verify/sharded/arena.py) or "pipe" (a trace under 1 MB, or that directory full).
        self.last_trace_via = ""
        self.exit_codes: list[int | None] = []
        self._zygote: Zygote | None = None
        self._stderr: list[_StderrRelay] = []
        self._warnings_registry: dict = {}  # what warnings.warn_explicit showed once (library_warnings.received)

    # ---- lifecycle ----------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.poll() is None for p in self._procs)

    def start(self) -> None:
        """Fork the ranks from the process's zygote (verify/sharded/zygote.py: one for every pool
        of the process), started the first time (a `python -m fsdp_verify.sharded.zygote` child:
        no re-import of the caller's __main__), each talking over two pipes; a restart after a
        rank failure is a fork, not a torch start."""
        self._stop_ranks()
        self._dir = Path(tempfile.mkdtemp(prefix="fsdp-verify-pool-", dir=memory_dir()))
        self._board = PhaseBoard(str(self._dir / "phases"), self.world_size, create=True)
        pg_timeout = max(self.timeout_s * 4, 60.0)  # the process group's own timeout acts after ours
        # this xdist worker's own GPUs when CUDA is present (verify/sharded/devices.py)
        env = {**os.environ, "PYTHONPATH": _import_path(), **pool_env(self.world_size)}
        if self._zygote is None:
            self._zygote = zygotes.shared({**os.environ, "PYTHONPATH": env["PYTHONPATH"]}, self.start_timeout_s)
        for rank in range(self.world_size):
            down_r, down_w = os.pipe()
            up_r, up_w = os.pipe()
            err_r, err_w = os.pipe()  # its stderr, relayed (_StderrRelay)
            args = [str(rank), str(self.world_size), str(self._dir), str(pg_timeout)]
            try:
                proc = self._zygote.spawn(args, (down_r, up_w, err_w), env)
            except ZygoteError as e:
                os.close(down_w)
                os.close(up_r)
                os.close(err_r)
                self._stop_ranks()
                raise RankFailure("start", rank, "start", str(e), {}) from None
            finally:  # the rank's ends: the zygote holds its own copies now
                os.close(down_r)
                os.close(up_w)
                os.close(err_w)
            self._procs.append(proc)
            self._stderr.append(_StderrRelay(err_r))
            self._to.append(Connection(down_w, readable=False))
            self._from.append(Connection(up_r, writable=False))
        self.starts += 1
        self._collect("start", self.start_timeout_s)

    def close(self) -> None:
        """Stop every worker (politely if idle, by SIGKILL otherwise) and the zygote if no other
        pool uses it. Leaves no process behind."""
        self._stop_ranks()
        if self._zygote is not None:
            zygote, self._zygote = self._zygote, None  # released once, whatever release does
            zygotes.release(zygote)

    def _stop_ranks(self, kill: bool = False) -> None:
        """Stop the ranks (`kill`: by SIGKILL without asking), keeping the zygote to fork the next."""
        for conn, p in zip(self._to, self._procs, strict=True):
            if kill:
                p.kill()
            else:
                with contextlib.suppress(OSError, ValueError):
                    conn.send(("stop",))
        deadline = time.monotonic() + 2.0
        codes = []
        for p in self._procs:
            try:
                p.wait(max(0.01, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5.0)
            codes.append(p.returncode)
        if codes:
            self.exit_codes = codes  # of the last workers stopped: 0 each after a polite stop
        for conn in self._to + self._from:
            conn.close()
        for relay in self._stderr:
            relay.join(1.0)
        self._procs, self._to, self._from, self._stderr = [], [], [], []
        if self._board is not None:
            self._board.close()
            self._board = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    # ---- running cases ------------------------------------------------------------------------
    def submit(self, case: Case, resume: dict | None = None) -> None:
        """Send a case to every rank; collect the result with `result()`. The caller may compute
        (e.g. the reference run) in between. `resume`: save a checkpoint after the last step
        ({"save": DIR}) or start from one ({"load": DIR}) (verify/sharded/loop.py)."""
        if case.world_size != self.world_size:
            raise ValueError(f"case world_size={case.world_size} but the pool has {self.world_size} ranks")
        if not self.alive:
            self.start()
        self._case = case  # what a crash's message names known causes of
        text = case.to_json()
        for conn in self._to:
            conn.send(("run", text, resume))

    def result(self, timeout_s: float | None = None) -> Trace:
        replies = self._collect("run", timeout_s or self.timeout_s)
        t = time.perf_counter()
        (header, buf), seconds, received_s = replies[0]
        trace = read_fill(header) if "path" in header else Trace.unpack(header, buf)
        self.last_profile = {**seconds, "receive trace": received_s, "decode trace": time.perf_counter() - t}
        self.last_trace_via = "arena" if "path" in header else "pipe"
        return trace

    def run(self, case: Case, timeout_s: float | None = None, resume: dict | None = None) -> Trace:
        self.submit(case, resume)
        return self.result(timeout_s)

    # ---- internals ----------------------------------------------------------------------------
    def _phases(self) -> dict[int, str]:
        return {r: self._board.read(r) for r in range(self.world_size)} if self._board else {}

    def _collect(self, what: str, timeout_s: float) -> dict[int, object]:
        """One reply from every rank, or a RankFailure (after which the pool is closed)."""
        replies: dict[int, object] = {}
        pending = set(range(self.world_size))
        deadline = time.monotonic() + timeout_s
        try:
            while pending:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise self._hang(pending, timeout_s)
                by_conn = {self._from[r]: r for r in pending}
                for conn in wait(list(by_conn), timeout=remaining):
                    rank = by_conn[conn]
                    try:
                        message = conn.recv()
                    except (EOFError, OSError):
                        raise self._crash(rank, what) from None
                    if message[0] == "error":
                        _, phase, detail, tb = message[:4]
                        self._warned(message[4] if len(message) > 4 else None)
                        dead = self._dead_peer(pending - {rank}) if "torch/distributed" in tb else None
                        if dead is not None:  # the root cause: the error was its peers' collective failing
                            raise self._crash(dead, what) from None
                        raise RankFailure("error", rank, phase, f"{detail}\n{tb}", self._phases())
                    if what == "run":
                        # rank 0's trace: a header, then its bytes (verify/sharded/worker.py)
                        t = time.perf_counter()
                        header, buf = message[1], None
                        if header is not None and "path" not in header:  # else rank 0's arena (worker.py run_case)
                            buf = bytearray(header["nbytes"])
                            try:
                                conn.recv_bytes_into(buf)
                            except (EOFError, OSError):
                                raise self._crash(rank, what) from None
                        replies[rank] = ((header, buf), message[2], time.perf_counter() - t)
                        self._warned(message[3] if len(message) > 3 else None)
                    else:
                        replies[rank] = message[1]
                        self._warned(message[2] if len(message) > 2 else None)
                    pending.discard(rank)
        except RankFailure:
            # The process group is unusable after a failure: the ranks go at once (none is owed a
            # polite stop, which waited for the survivors' shutdown), new ones are forked next case.
            self._stop_ranks(kill=True)
            raise
        return replies

    def _warned(self, entries: list[dict] | None) -> None:
        """A rank's library warnings (verify/library_warnings.py): into the command's tally, or
        issued here once each per pool."""
        if entries:
            received(entries, self._warnings_registry)

    def _dead_peer(self, ranks: set[int], grace_s: float = 2.0) -> int | None:
        """A rank among `ranks` whose process has exited, waiting up to `grace_s` for one. A rank
        that failed inside a collective is often the victim of a peer that just died (gloo:
        "Connection closed by peer"); its error can reach us before the dead rank's pipe closes."""
        deadline = time.monotonic() + grace_s
        while True:
            for r in sorted(ranks):
                if self._procs[r].poll() is not None:
                    return r
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)

    def _crash(self, rank: int, what: str) -> RankFailure:
        proc = self._procs[rank]
        try:
            code = proc.wait(2.0)
        except subprocess.TimeoutExpired:
            code = None
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        self._stderr[rank].join(1.0)  # what it wrote before it died
        said = collective_mismatch(self._stderr[rank].tail())
        if said:
            phases = self._phases()
            where = ", ".join(f"rank {r} in {p!r}" for r, p in sorted(phases.items()))
            how += f": a collective mismatch between ranks ({where}): the ranks issued different collectives, or the same one with other sizes ({said})"
            how += known_crash(self._case)
        fatal = fatal_error(self._stderr[rank].tail())
        if fatal:
            how += f"; its last words:\n{fatal}"
        return RankFailure(
            "crash" if what == "run" else "start", rank, self._board.read(rank), f"process {how}", self._phases()
        )

    def _hang(self, pending: set[int], timeout_s: float) -> RankFailure:
        """Which rank hung? Dump every pending rank's Python stack: a rank that is not inside a
        torch.distributed call is the one holding the others up. Else blame ranks by phase."""
        phases = self._phases()
        stacks = self._dump_stacks(pending)
        outside = [r for r in sorted(pending) if stacks.get(r) and "torch/distributed" not in stacks[r]]
        culprit = outside[0] if outside else sorted(pending)[0]
        if not outside and len({phases[r] for r in pending}) > 1:
            # All wait in collectives but at different places: the odd one out skipped or added one.
            counts: dict[str, list[int]] = {}
            for r in sorted(pending):
                counts.setdefault(phases[r], []).append(r)
            culprit = min(counts.values(), key=len)[0]
        where = stacks.get(culprit, "").strip().splitlines()
        top = where[1].strip() if len(where) > 1 else "no stack"
        detail = f"no progress for {timeout_s:.0f} s (hang); innermost frame: {top}"
        return RankFailure("hang", culprit, phases[culprit], detail, phases)

    def _dump_stacks(self, ranks: set[int]) -> dict[int, str]:
        if self._dir is None:
            return {}
        for r in ranks:
            if self._procs[r].poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self._procs[r].pid, signal.SIGUSR1)
        time.sleep(0.5)
        out = {}
        for r in ranks:
            path = self._dir / f"stack-{r}.txt"
            out[r] = path.read_text(errors="replace") if path.exists() else ""
        return out


class _StderrRelay:
    """A rank's stderr, passed on to ours as it comes (as an inherited one would be) and its last
    few KB kept: what a rank that died said just before (gloo's message before its abort)."""

    KEEP = 16384

    def __init__(self, fd: int):
        self._fd, self._tail = fd, bytearray()
        self._thread = threading.Thread(target=self._relay, daemon=True)
        self._thread.start()

    def _relay(self) -> None:
        try:
            while chunk := os.read(self._fd, 65536):
                with contextlib.suppress(OSError):
                    os.write(2, chunk)
                self._tail += chunk
                del self._tail[: -self.KEEP]
        except OSError:
            pass
        finally:
            os.close(self._fd)

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)

    def tail(self) -> str:
        return bytes(self._tail).decode(errors="replace")


# What a process group's backend says when the ranks' collectives do not match (gloo aborts with
# the first; torch's own checks, TORCH_DISTRIBUTED_DEBUG=DETAIL, say the others).
MISMATCH_SIGNS = (
    "Received data size doesn't match expected size",
    "Is there a distributed collective mismatch",
    "Detected mismatch between collectives",
)


def fatal_error(stderr_tail: str, lines: int = 30) -> str:
    """What faulthandler wrote when the rank died of a fatal signal ("Fatal Python error: ..." and
    the Python stacks of its threads, verify/sharded/worker.py), its first `lines`, or ''."""
    start = stderr_tail.rfind("Fatal Python error")
    if start < 0:
        return ""
    return "\n".join(stderr_tail[start:].splitlines()[:lines])


def collective_mismatch(stderr_tail: str) -> str:
    """The line of a rank's last output that says its collectives did not match its peers', or ''."""
    for line in reversed(stderr_tail.splitlines()):
        if any(sign in line for sign in MISMATCH_SIGNS):
            return line.strip()[-300:]
    return ""


# ---- one pool per world size per process (a pytest-xdist worker is a process) ---------------------
_POOLS: dict[int, RankPool] = {}


def get_pool(world_size: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> RankPool:
    pool = _POOLS.get(world_size)
    if pool is None:
        pool = _POOLS[world_size] = RankPool(world_size, timeout_s)
    pool.timeout_s = timeout_s
    return pool


@atexit.register
def close_all_pools() -> None:
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


def memory_dir() -> str | None:
    """Where a pool's directory goes: $FSDP_VERIFY_MEMORY_DIR when set, else /dev/shm where it is a
    writable directory, so that the traces and pieces that travel through it as files
    (verify/sharded/arena.py) cost a memory copy; else None, the system's temp directory. A
    full one costs nothing but speed: the process group and the pipes then carry them."""
    chosen = os.environ.get("FSDP_VERIFY_MEMORY_DIR")
    if chosen:
        return chosen
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None


def _import_path() -> str:
    """This process's sys.path, so a rank imports exactly what we import: the installed toolkit
    (`fsdp_verify`, wherever pip put it) and a user's engine or model module found through the
    working directory or a path pytest added."""
    entries = [p or os.getcwd() for p in sys.path]
    return os.pathsep.join(dict.fromkeys(entries))
