"""The example dimension's mutant (tests/dims_example/__init__.py)."""

from __future__ import annotations

from fsdp_verify.engines.capabilities import FSDP2
from fsdp_verify.engines.fsdp2 import fully_shard_engine
from tests.dims_example import _scale


def wrong_factor(model, mesh, spec):
    """The ranks' model scaled once more, by 1.5, before the package's own scaling."""
    _scale(model, 1.5)
    return fully_shard_engine(model, mesh, spec)


wrong_factor.capabilities = FSDP2
