"""A crashed, raising or hung rank ends in a RankFailure naming rank and phase, within the
timeout, with no process left behind, and the pool runs the next case."""

import os

import pytest

from fsdp_verify.runner import check_case
from fsdp_verify.sharded.pool import RankFailure, RankPool
from tests.conftest import alive, mlp_case

FAULTY = "tests/engines/faulty.py"


@pytest.fixture(scope="module")
def pool():
    # A hang is named when this runs out: a healthy case here takes 0.1-0.5 s loaded (the ranks'
    # start is timed apart, by start_timeout_s), so 4 s leaves margin and makes each hang test
    # wait 4 s, not 8.
    with RankPool(2, timeout_s=4.0) as p:
        yield p


def _fail(pool, engine):
    if not pool.alive:
        pool.start()
    ranks = set(pool.pids())
    with pytest.raises(RankFailure) as e:
        check_case(mlp_case(2, engine=f"{FAULTY}:{engine}"), pool=pool)
    assert not pool.alive  # killed, to be restarted by the next case
    assert not [pid for pid in ranks if alive(pid)], "a failed rank's process was left behind"
    return e.value


def _recovers(pool):
    assert check_case(mlp_case(2), pool=pool).ok


def test_crashed_rank_is_named_with_its_phase(pool):
    failure = _fail(pool, "rank1_crashes_in_forward")
    assert (failure.kind, failure.rank) == ("crash", 1)
    assert "forward" in failure.phase
    assert "exited with code 7" in failure.detail
    _recovers(pool)


def test_a_segfaulted_rank_is_named_with_its_phase_and_its_python_stack(pool):
    """A segfault in a library (CI met one in a rank, no stack said where): the failure quotes what
    faulthandler wrote, the crashing thread's Python stack down to the line."""
    failure = _fail(pool, "rank1_segfaults_in_forward")
    assert (failure.kind, failure.rank) == ("crash", 1)
    assert "killed by signal 11" in failure.detail
    assert "Fatal Python error: Segmentation fault" in failure.detail, failure.detail
    assert "faulty.py" in failure.detail, failure.detail
    _recovers(pool)


def test_hung_rank_is_named_with_its_phase(pool):
    failure = _fail(pool, "rank1_hangs_in_forward")
    assert (failure.kind, failure.rank) == ("hang", 1)
    assert "step 1 forward" in failure.phase
    assert "sleep" in failure.detail or "faulty.py" in failure.detail
    _recovers(pool)


def test_raising_rank_is_named(pool):
    failure = _fail(pool, "rank0_raises_while_sharding")
    assert (failure.kind, failure.rank) == ("error", 0)
    assert failure.phase == "shard (engine)"
    assert "engine bug on rank 0" in failure.detail
    _recovers(pool)


def test_skipped_collective_ends_in_a_named_failure(pool):
    failure = _fail(pool, "rank1_skips_a_collective")
    assert failure.kind in ("hang", "error")
    assert failure.rank in (0, 1) and failure.phase
    _recovers(pool)


def test_a_peers_collective_error_is_blamed_on_the_rank_that_died(pool):
    """Rank 1 drops its connections, so rank 0's collective fails and reports first, then dies:
    the dead rank is the root cause (this once flaked in CI as "rank 0 error")."""
    failure = _fail(pool, "rank1_drops_its_connections_then_dies")
    assert (failure.kind, failure.rank) == ("crash", 1), str(failure)
    assert failure.phase.startswith("step 1 forward")
    _recovers(pool)


@pytest.mark.parametrize(
    ("step", "kind", "phase"),
    [
        ("rank1_dies_in_its_backward", "crash", "step 1 user step: loss and backward after forward 0"),
        ("rank1_dies_in_its_optimizer_step", "crash", "step 1 user step: clip and optimizer step"),
        ("rank1_raises_before_its_forward", "error", "step 1 user step"),
        ("rank1_raises_in_its_backward", "error", "step 1 user step: loss and backward after forward 0"),
    ],
)
def test_a_rank_failing_in_a_users_step_is_named_with_that_part_of_the_step(pool, step, kind, phase):
    """Before, a rank that died after the toolkit recorded the forward's output or the gradients
    was named with that record phase ("step 1 record gradients"), and a step that raised was named
    "clip and optimizer step" wherever it raised: the gradients were recorded on the way out."""
    if not pool.alive:
        pool.start()
    with pytest.raises(RankFailure) as e:
        check_case(mlp_case(2, step=f"tests/user/faulty_steps.py:{step}"), pool=pool)
    assert (e.value.kind, e.value.rank, e.value.phase) == (kind, 1, phase), str(e.value)
    if kind == "error":
        assert "the user's step failed on rank 1" in e.value.detail
    _recovers(pool)


@pytest.mark.parametrize(
    ("step", "phase"),
    [(None, "step 1 forward (micro-batch 0)"), ("tests/user/steps.py:train_step", "step 1 user step: forward 0")],
    ids=["toolkit-loop", "user-step"],
)
def test_a_rank_failing_inside_a_users_forward_is_named_with_the_forward(pool, step, phase):
    """A user's model raising inside a sharded block's forward, on rank 1 only: the failure names
    rank 1 and the forward (in the toolkit's loop and in a user's step), not a phase after it."""
    from fsdp_verify.case import Case, ModelSpec
    from fsdp_verify.case_specs import DataSpec

    if not pool.alive:
        pool.start()
    model = ModelSpec(kind="custom", factory="tests/user/models.py:raises_in_forward_on_rank_1")
    case = Case(world_size=2, model=model, steps=1, wrap=("UserBlock", ""), data=DataSpec(batch_size=4), step=step)
    with pytest.raises(RankFailure) as e:
        check_case(case, pool=pool)
    assert (e.value.kind, e.value.rank, e.value.phase) == ("error", 1, phase), str(e.value)
    assert "RuntimeError: the user's block failed on rank 1" in e.value.detail
    _recovers(pool)


def test_closing_the_pool_leaves_no_process(no_leftover_children):
    with RankPool(2) as p:
        p.start()
        assert len(p.pids()) == 2


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_a_restart_after_a_failure_forks_the_new_ranks_from_the_same_zygote(pool):
    """A crash ends the process group, so the next case gets new ranks: forked by the pool's
    zygote, which imported torch once (verify/sharded/zygote.py), not started afresh (seconds
    each); the survivors of the broken group are killed at once, not asked to stop."""
    if not pool.alive:
        pool.start()
    zygote = pool._zygote._proc.pid
    assert {_parent(pid) for pid in pool.pids()} == {zygote} and zygote != os.getpid()
    _fail(pool, "rank1_crashes_in_forward")
    assert pool.exit_codes == [-9, 7]  # rank 0 killed, rank 1's own exit code
    _recovers(pool)
    assert pool._zygote._proc.pid == zygote and {_parent(pid) for pid in pool.pids()} == {zygote}
