"""A warm pool's ranks stay as they were across cases: a case that makes process groups (FSDP2
does in every `fully_shard` with an int `reshard_after_forward`) does not leave them, and their
threads, behind for the thousands of cases after it."""

import os

from fsdp_verify.sharded.pool import get_pool
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
