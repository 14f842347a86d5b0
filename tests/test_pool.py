"""A warm pool's ranks stay as they were across cases: a case that makes process groups (FSDP2
does in every `fully_shard` with an int `reshard_after_forward`) does not leave them, and their
threads, behind for the thousands of cases after it."""

import contextlib
import os
import resource
import signal

import torch

from fsdp_verify.case import Case, ModelSpec
from fsdp_verify.case_specs import DataSpec
from fsdp_verify.sharded.pool import RankPool, get_pool
from tests.conftest import mlp_case


def _threads(pids: list[int]) -> list[int]:
    return [len(os.listdir(f"/proc/{pid}/task")) for pid in pids]


def test_cases_that_make_process_groups_leave_none_behind():
    pool = get_pool(4)
    case = mlp_case(4, reshard_after_forward=2, wrap=("layers.0", "layers.1", ""))
    assert pool.run(case) is not None
    before = _threads(pool.pids())
    for _ in range(3):
        pool.run(case)
    assert _threads(pool.pids()) == before


def test_an_idle_pool_stops_cleanly_and_says_where_a_case_spent_its_time():
    """Workers leave through leave_process_group + exit_now: exit code 0, not the SIGABRT (-6) of
    gloo groups freed during interpreter finalisation. Rank 0 reports its phases with the trace."""
    pool = RankPool(2)
    try:
        assert pool.run(mlp_case(2)) is not None
        profile = pool.last_profile
    finally:
        pool.close()
    assert pool.exit_codes == [0, 0]
    for kind in ("build model", "fully_shard (engine)", "training", "record + gather: gradients", "decode trace"):
        assert kind in profile, (kind, sorted(profile))
    assert all(v >= 0 for v in profile.values())


@contextlib.contextmanager
def _files_limited_to(nbytes: int):
    """Processes started inside inherit a file-size limit: a write past it fails (EFBIG; the
    signal ignored, as a full tmpfs fails a write with ENOSPC)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


def test_records_reach_the_pool_whole_through_its_memory_directory_or_without_it():
    """Rank 0's trace and the other ranks' pieces travel as files in the pool's memory directory
    (verify/sharded/arena.py); where that is full (here: a 64 KB file-size limit the ranks
    inherit) they go through the pipe and gloo, and the trace is the same to the bit."""
    case = Case(
        model=ModelSpec(kind="mlp", widths=(32, 256, 256, 8)), world_size=2, steps=3, data=DataSpec(batch_size=4)
    )
    traces, via = [], []
    for limited in (False, True):
        with _files_limited_to(64 << 10) if limited else contextlib.nullcontext():
            pool = RankPool(2)
            pool.start()
        try:
            for _ in range(2):  # the second case rewrites the arenas the first one wrote
                trace = pool.run(case)
            traces.append(trace)
            via.append(pool.last_trace_via)
        finally:
            pool.close()
    assert via == ["arena", "pipe"]
    arena, pipe = traces
    assert sum(t.numel() * t.element_size() for t in arena.records.values()) > 64 << 10  # past the limit
    assert list(arena.records) == list(pipe.records) and arena.meta == pipe.meta
    for key, value in arena.records.items():
        assert value.dtype == pipe.records[key].dtype and torch.equal(value, pipe.records[key]), key


def _probes_after_a_case(rank: int, init: str, out: str) -> None:
    import torch.distributed as dist

    from fsdp_verify.probes import PROBES
    from fsdp_verify.sharded import loop
    from fsdp_verify.sharded.loop import RankContext, run_sharded
    from fsdp_verify.sharded.worker import MeshCache

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=0, world_size=1)
    made = []
    loop.PROBES = [type(P.__name__, (P,), {"__init__": _noting(P, made)}) for P in PROBES]
    trace = run_sharded(mlp_case(1), RankContext(0, 1, torch.device("cpu"), MeshCache("cpu").get((1,))))
    holding = [type(p).__name__ for p in made if p.trace is trace]
    with open(out, "w") as f:
        f.write(",".join(holding) if trace.records and made else "no probes or no records")
    dist.destroy_process_group()


def _noting(P, made):
    def __init__(self, *args, **kwargs):
        P.__init__(self, *args, **kwargs)
        made.append(self)

    return __init__


def test_no_probe_holds_the_trace_after_the_case(tmp_path):
    """The engine's module holds the probes through its hooks, in reference cycles that live until
    Python's cyclic collector runs; a probe that kept the trace kept it (70 MB on a medium case)
    that long, and a pool's rank 0 grew to 1 GB. After the case, none holds it."""
    import torch.multiprocessing as mp

    out = tmp_path / "holding"
    mp.spawn(_probes_after_a_case, args=(str(tmp_path / "init"), str(out)), nprocs=1)
    assert out.read_text() == ""


def test_new_ranks_see_the_path_and_environment_of_now_not_of_the_zygotes_start(tmp_path, monkeypatch):
    """Ranks are forked from a zygote started with the pool (verify/sharded/zygote.py); ranks
    started later still import through a path added since, and see a variable set since, as a
    process started then would."""
    from fsdp_verify.runner import check_case

    (tmp_path / "late_engine.py").write_text(
        "import os\nfrom fsdp_verify.engines.fsdp2 import fully_shard_engine\n\n"
        "def shard(model, mesh, spec):\n"
        "    assert os.environ['FSDP_VERIFY_SET_LATER'] == 'yes'\n"
        "    return fully_shard_engine(model, mesh, spec)\n"
    )
    with RankPool(2) as pool:
        pool.start()
        zygote = pool._zygote._proc.pid
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.setenv("FSDP_VERIFY_SET_LATER", "yes")
        pool.start()  # new ranks
        assert check_case(mlp_case(2, engine="late_engine:shard"), pool=pool).ok
        assert pool._zygote._proc.pid == zygote


def test_the_pools_of_a_process_share_one_zygote_which_stops_with_the_last(monkeypatch):
    """A sweep over world sizes 1-4 has four pools; each started a zygote importing torch and
    Dynamo (3-4 s of CPU) before one was shared (verify/sharded/zygote.py `shared`). A pool
    started under other resource limits, which ranks inherit from their zygote, gets its own."""
    from tests.conftest import alive

    # a variable read at import: a zygote of this test's own, not this worker's pools' one
    monkeypatch.setenv("FSDP_VERIFY_ZYGOTE_TEST", "1")
    with RankPool(1) as one, RankPool(3) as three:
        one.start()
        three.start()
        zygote = one._zygote._proc.pid
        assert three._zygote._proc.pid == zygote
        with _files_limited_to(1 << 30), RankPool(1) as limited:
            limited.start()
            assert limited._zygote._proc.pid != zygote
        one.close()
        assert alive(zygote) and three.run(mlp_case(3)).meta  # still serves the other pool
    assert not alive(zygote)


def test_ranks_work_where_their_pool_was_started(tmp_path, monkeypatch):
    """The zygote was started where the first pool was; a pool started elsewhere (which may share
    it: each rank is sent its pool's directory) resolves a relative path (an engine's file) from
    its own directory."""
    from fsdp_verify.runner import check_case

    (tmp_path / "here_engine.py").write_text(
        "from fsdp_verify.engines.fsdp2 import fully_shard_engine\n\n"
        "def shard(model, mesh, spec):\n"
        "    return fully_shard_engine(model, mesh, spec)\n"
    )
    monkeypatch.setenv("FSDP_VERIFY_ZYGOTE_TEST", "cwd")  # a zygote of this test's own
    with RankPool(2) as first:
        first.start()
        monkeypatch.chdir(tmp_path)
        with RankPool(2) as second:
            assert check_case(mlp_case(2, engine="here_engine.py:shard"), pool=second).ok


def test_pools_whose_shared_zygote_died_start_again(monkeypatch):
    """The ranks die with their zygote (PR_SET_PDEATHSIG): every pool forked by it must see its
    ranks gone, not only the one that notices first, and the next case starts them again."""
    from fsdp_verify.runner import check_case

    monkeypatch.setenv("FSDP_VERIFY_ZYGOTE_TEST", "dies")  # a zygote of this test's own
    with RankPool(1) as one, RankPool(2) as two:
        one.start()
        two.start()
        os.kill(one._zygote._proc.pid, signal.SIGKILL)
        one._zygote._proc.wait(10)  # dead (a case already running would end as a crash instead)
        assert check_case(mlp_case(1), pool=one).ok
        assert check_case(mlp_case(2), pool=two).ok
        assert one._zygote is two._zygote and one._zygote.alive


def test_ranks_start_with_the_model_libraries_their_pools_process_has_loaded():
    """A rank imports a model library after its fork (transformers' Llama: 1.9 s a rank, measured);
    the zygote imports what the pool's process has loaded before it forks, once, and every rank
    forked later has it (the test suite's pools of several world sizes: 119-130 s -> 100 s on the
    heavy modules). The engine fails in a rank that had to import it itself."""
    import transformers.models.llama.modeling_llama  # noqa: F401  (what a reference of a Llama case loads)

    from fsdp_verify.runner import check_case
    from fsdp_verify.sharded.zygote import loaded_model_libraries

    assert "transformers.models.llama.modeling_llama" in loaded_model_libraries()
    with RankPool(2) as pool:  # fresh ranks, forked now
        verdict = check_case(mlp_case(2, engine="tests/engines/preloaded.py:library_preloaded"), pool=pool)
    assert verdict.ok, verdict.summary()


def test_a_library_that_bound_a_collective_before_the_probe_is_recorded_and_torch_is_left_alone():
    """Forked with torchtitan imported, a rank holds its dispatcher's `all_to_all_single` bound by
    name before the communication probe wraps funcol: the probe points such a binding at its
    wrapper, and leaves torch's own modules as they are (the contracts model what torch records)."""
    import sys
    import types

    from fsdp_verify.probes.comm import _rebind_copies

    def original():
        pass

    def wrapper():
        pass

    library, torch_own = types.ModuleType("a_library.dispatch"), types.ModuleType("torch.a_module")
    library.all_to_all_single = torch_own.all_to_all_single = original
    sys.modules.update({library.__name__: library, torch_own.__name__: torch_own})
    try:
        _rebind_copies({id(original): wrapper})
    finally:
        del sys.modules[library.__name__], sys.modules[torch_own.__name__]
    assert library.all_to_all_single is wrapper and torch_own.all_to_all_single is original
