"""A warm pool's ranks stay as they were across cases: a case that makes process groups (FSDP2
does in every `fully_shard` with an int `reshard_after_forward`) does not leave them, and their
threads, behind for the thousands of cases after it."""

import os

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
