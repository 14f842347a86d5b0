"""One rank's process: joins the process group once, then runs case after case.

Started by the pool (`worker_main`) or, under torchrun, used in place (`init_in_place`). The
process group and device meshes live as long as the process, so a tiny case costs milliseconds
instead of the seconds it takes to start torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import faulthandler
import gc
import mmap
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from dataclasses import replace
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from fsdp_verify.case import Case
from fsdp_verify.dims.parallel_dims import ParallelDims
from fsdp_verify.library_warnings import Tally, collecting
from fsdp_verify.sharded.allocator import keep_freed_memory
from fsdp_verify.sharded.arena import arena, release_arenas
from fsdp_verify.sharded.collect import SPILL_FROM_BYTES
from fsdp_verify.sharded.loop import RankContext, run_sharded
from fsdp_verify.torch_support import clear_dtensor_caches

PHASE_BYTES = 96  # per-rank slot in the shared phase board


class PhaseBoard:
    """A small shared file (mmap) where each rank writes the phase it is in, so the pool can say
    where a rank was when it hung or died."""

    def __init__(self, path: str, world_size: int, rank: int | None = None, create: bool = False):
        size = world_size * PHASE_BYTES
        if create:
            with open(path, "wb") as f:
                f.write(b"\0" * size)
        self._file = open(path, "r+b")  # noqa: SIM115 (lives as long as the board)
        self._map = mmap.mmap(self._file.fileno(), size)
        self.world_size, self.rank = world_size, rank

    def __call__(self, phase: str) -> None:
        start = self.rank * PHASE_BYTES
        self._map[start : start + PHASE_BYTES] = phase.encode()[: PHASE_BYTES - 1].ljust(PHASE_BYTES, b"\0")

    def read(self, rank: int) -> str:
        start = rank * PHASE_BYTES
        return self._map[start : start + PHASE_BYTES].split(b"\0", 1)[0].decode(errors="replace")

    def close(self) -> None:
        self._map.close()
        self._file.close()


def device_for(local_rank: int) -> tuple[torch.device, str]:
    """One GPU per rank with NCCL when CUDA is there; else CPU with gloo. (CUDA path: untested here.)"""
    if torch.cuda.is_available() and os.environ.get("FSDP_VERIFY_DEVICE", "") != "cpu":
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), "nccl"
    return torch.device("cpu"), "gloo"


class MeshCache:
    """Device meshes by their degrees; a new mesh makes new process groups, so make each once.
    The mesh itself is the case's `ParallelDims` (verify/dims/parallel_dims.py)."""

    def __init__(self, device_type: str):
        self.device_type = device_type
        self._meshes: dict[ParallelDims, DeviceMesh] = {}

    def get(self, shape: tuple[int, ...], ep: int = 1, pp: int = 1, tp: int = 1) -> DeviceMesh:
        """The mesh of the data-parallel mesh `shape` with those degrees (`ParallelDims.build`)."""
        return self.dims(ParallelDims.over(tuple(shape), pp=pp, tp=tp, ep=ep))

    def dims(self, dims: ParallelDims) -> DeviceMesh:
        if dims not in self._meshes:
            plain = self.dims(replace(dims, ep=1)) if dims.ep > 1 else None  # the dense parameters' mesh
            self._meshes[dims] = dims.build(self.device_type, plain)
        return self._meshes[dims]

    def of(self, case: Case) -> DeviceMesh:
        """The case's mesh: every rank's."""
        return self.dims(case.parallel)


def _die_with_parent() -> None:
    """A worker must never outlive the process that started it."""
    with contextlib.suppress(OSError, AttributeError):  # Linux: the kernel kills us with the parent
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


@contextlib.contextmanager
def groups_released(clock=None) -> Iterator[None]:
    """Destroys the process groups made while a case ran. FSDP2 builds a new DeviceMesh, so new
    groups, in every `fully_shard` call with an int `reshard_after_forward`; a gloo group holds
    threads and sockets until its last reference goes, and a worker runs thousands of cases (a
    nightly sweep's world-size-4 ranks had grown to 1,500 threads each, most CPU time then went
    to the kernel). DTensor's sharding caches hold the case's meshes too: they are cleared, which
    also keeps a later mesh that compares equal from meeting a destroyed group there. Cases that
    make no group (the common ones) pay nothing."""
    before = set(dist.distributed_c10d._world.pg_map)
    try:
        yield
    finally:
        if clock is not None:
            clock.mark("release groups")
        made = [g for g in dist.distributed_c10d._world.pg_map if g not in before]
        for group in made:
            with contextlib.suppress(Exception):  # a group a crashed case left mid-collective
                dist.destroy_process_group(group)
        if made:
            clear_dtensor_caches()
            gc.collect()  # the FSDP state that holds the groups sits in reference cycles


def phase_kind(phase: str) -> str:
    """The profile's row for a loop phase (verify/sharded/loop.py names them)."""
    if phase.startswith("build"):
        return "build model"
    if phase.startswith("shard"):
        return "fully_shard (engine)"
    if "probes" in phase:
        return "probes"
    if " record " in phase or "gather" in phase:
        return "record + gather"
    if phase == "done":
        return "finish"
    return "training"


class PhaseClock:
    """The phase board plus a clock: seconds spent per kind of phase in the current case, sent
    back with its trace (`RankPool.last_profile`). A perf_counter call per phase: free."""

    def __init__(self, board):
        self.board = board
        self.seconds: dict[str, float] = {}
        self._kind: str | None = None
        self._t = time.perf_counter()

    def __call__(self, phase: str, kind: str | None = None) -> None:
        self.board(phase)
        kind = kind or phase_kind(phase)
        if kind == "record + gather":  # which record: "record + gather: gradients", ...
            kind = f"{kind}: {phase.split(' record ', 1)[-1] if ' record ' in phase else phase}"
        self.mark(kind)

    def mark(self, kind: str | None) -> None:
        now = time.perf_counter()
        if self._kind is not None:
            self.seconds[self._kind] = self.seconds.get(self._kind, 0.0) + now - self._t
        self._kind, self._t = kind, now

    def read(self, rank: int) -> str:
        return self.board.read(rank)


def run_case(
    case_json: str,
    rank: int,
    world_size: int,
    device: torch.device,
    meshes: MeshCache,
    board,
    pool_dir: str,
    resume: dict | None = None,
) -> tuple[tuple[dict, torch.Tensor | None] | None, dict[str, float]]:
    """Rank 0 returns its trace as a header and, unless it went into its arena in `pool_dir`
    that the pool reads (the header names it), its packed bytes for the pipe."""
    clock = PhaseClock(board)
    clock.mark("decode case")
    case = Case.from_json(case_json)
    clock.mark("mesh")
    mesh = meshes.of(case)
    ctx = RankContext(
        rank=rank, world_size=world_size, device=device, mesh=mesh, phase=clock, spill_dir=pool_dir, resume=resume
    )
    with groups_released(clock):
        trace = run_sharded(case, ctx)
    clock("serialise trace", "serialise trace")
    packed = None
    if trace is not None:
        # A 70 MB trace took 240 ms to pack and pipe, its arena 20 ms (verify/sharded/arena.py);
        # a tiny one pipes in a millisecond.
        if sum(t.numel() * t.element_size() for t in trace.records.values()) >= SPILL_FROM_BYTES:
            with contextlib.suppress(OSError):  # a full tmpfs: the pipe
                packed = arena(pool_dir, "trace").begin().add_trace(trace).header(trace.side, trace.meta), None
        if packed is None:
            packed = trace.pack()
    clock.mark(None)
    return packed, clock.seconds


def worker_main(
    rank: int, world_size: int, pool_dir: str, conn_in: Connection, conn_out: Connection, pg_timeout_s: float
) -> None:
    _die_with_parent()
    # Ctrl-C in a terminal reaches the whole foreground process group, ranks included; the pool's
    # owner decides what happens (fuzz and sweep write their report and stop the ranks), so a rank
    # never dies halfway through a collective on its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    keep_freed_memory()  # a case's records are copied into the pages the last case freed
    torch.set_num_threads(1)  # world_size processes share the machine's cores
    # The variables torchrun sets, so that a user's factory or step that reads them (to seed, to
    # log, to pick a device) sees what it would see there, and the build check can name a
    # factory that builds by rank.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    os.environ.update(LOCAL_WORLD_SIZE=str(world_size))
    # On SIGUSR1 the pool asks for our Python stack, to tell a hung rank from one waiting on it.
    stack_file = open(os.path.join(pool_dir, f"stack-{rank}.txt"), "w")  # noqa: SIM115 (lives with the process)
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=False)
    # A rank killed by a fatal signal (a segfault in a library) writes its threads' Python stacks
    # to its stderr first, which the pool relays and quotes in the crash it reports.
    faulthandler.enable(all_threads=True)
    # Library warnings go back with each reply, tallied (verify/library_warnings.py), not to stderr.
    with collecting() as warned:
        _serve(rank, world_size, pool_dir, conn_in, conn_out, pg_timeout_s, warned)
    release_arenas()
    leave_process_group()
    exit_now(0)


def _serve(
    rank: int,
    world_size: int,
    pool_dir: str,
    conn_in: Connection,
    conn_out: Connection,
    pg_timeout_s: float,
    warned: Tally,
) -> None:
    """Join the process group, then run the cases the pool sends until it says stop; each reply
    carries the warnings issued since the last one."""
    board = PhaseBoard(os.path.join(pool_dir, "phases"), world_size, rank)
    board("joining process group")
    device, backend = device_for(rank)
    store = dist.FileStore(os.path.join(pool_dir, "store"), world_size)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=pg_timeout_s)
    )
    meshes = MeshCache(device.type)
    board("idle")
    conn_out.send(("ready", None, warned.drain()))
    while True:
        try:
            message = conn_in.recv()
        except (EOFError, OSError):
            break
        if message[0] == "stop":
            break
        case_json, resume = message[1], (message[2] if len(message) > 2 else None)
        try:
            packed, seconds = run_case(case_json, rank, world_size, device, meshes, board, pool_dir, resume)
            board("idle")
            # The trace as a header, then (unless the header names its file) its bytes straight
            # from the packed tensor (no pickle, no copy on this side); the pool reads them into
            # one buffer (RankPool._collect).
            conn_out.send(("ok", packed[0] if packed else None, seconds, warned.drain()))
            if packed and packed[1] is not None:
                conn_out.send_bytes(memoryview(packed[1].numpy()))
        except BaseException as e:  # report and stay alive; the pool decides whether to restart
            conn_out.send(
                ("error", board.read(rank), f"{type(e).__name__}: {e}", traceback.format_exc(), warned.drain())
            )


def leave_process_group() -> None:
    """Destroy every process group and let their C++ objects go while the interpreter is fully
    alive. `destroy_process_group()` alone only unregisters a group: the object (and gloo's
    worker threads, which may still hold tensors of finished work) lives as long as Python
    references to it (FSDP states in reference cycles, DTensor's sharding caches), and so could
    be freed during interpreter finalisation, where releasing those tensors takes the GIL of a
    dying interpreter: SIGABRT at exit (bench/overhead.py died so in one run of two)."""
    if dist.is_initialized():
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    clear_dtensor_caches()
    gc.collect()


def exit_now(code: int) -> None:
    """End a rank process without interpreter finalisation (no C++ static destructors racing
    gloo's threads): flush what Python buffered and `os._exit`. Call `leave_process_group` first."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> None:
    """`python -m fsdp_verify.sharded.worker RANK WORLD_SIZE POOL_DIR FD_IN FD_OUT PG_TIMEOUT`, started by the pool."""
    rank, world_size, pool_dir, fd_in, fd_out, pg_timeout = (argv or sys.argv[1:])[:6]
    conn_in = Connection(int(fd_in), writable=False)
    conn_out = Connection(int(fd_out), readable=False)
    worker_main(int(rank), int(world_size), pool_dir, conn_in, conn_out, float(pg_timeout))


if __name__ == "__main__":
    main()
