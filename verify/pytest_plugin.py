"""pytest plugin (entry point `pytest11`): a per-process rank pool and a fixture that checks a
case. Under pytest-xdist every worker is its own process and so gets its own pools (FileStore
rendezvous in a private temp dir: no ports or files shared between workers)."""

from __future__ import annotations

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fsdp-verify")
    group.addoption("--fsdp-engine", default="fsdp2", help="engine under test (fsdp2 | pkg.module:NAME | file.py:NAME)")
    group.addoption("--fsdp-timeout", type=float, default=120.0, help="seconds before a rank counts as hung")


@pytest.fixture(scope="session")
def fsdp_engine(request: pytest.FixtureRequest) -> str:
    return request.config.getoption("--fsdp-engine")


@pytest.fixture
def fsdp_check(request: pytest.FixtureRequest):
    """`fsdp_check(case) -> Verdict`, run on this process's warm pool for the case's world size."""
    from verify.pool import get_pool
    from verify.runner import check_case

    timeout = request.config.getoption("--fsdp-timeout")

    def check(case, **kwargs):
        return check_case(case, pool=get_pool(case.world_size, timeout), **kwargs)

    return check
