"""Engines: the sharding layer under test. The training loop is the toolkit's, always the same.

An engine is a callable `NAME(model, mesh, spec) -> nn.Module`, called on every rank after the
model was built identically everywhere. Name one as `fsdp2` (built in), `pkg.module:NAME` or
`path/to/file.py:NAME`.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

from torch import nn

from fsdp_verify.engines.arithmetic import FSDP2, Arithmetic, arithmetic_of
from fsdp_verify.engines.spec import ShardSpec

Engine = Callable[..., nn.Module]

BUILTIN = {
    "fsdp2": "fsdp_verify.engines.fsdp2:fully_shard_engine",
    "fsdp1": "fsdp_verify.engines.fsdp1:fsdp1_engine",
    "flat": "fsdp_verify.engines.flat.engine:flat_engine",
}


class EngineLoadError(RuntimeError):
    """The engine string names nothing that can be imported and called."""


def resolve_engine(name: str) -> Engine:
    target = BUILTIN.get(name, name)
    if ":" not in target:
        raise EngineLoadError(f"engine: expected 'fsdp2', 'pkg.module:NAME' or 'path/file.py:NAME', got {name!r}")
    where, attr = target.rsplit(":", 1)
    try:
        module = _load_file(where) if where.endswith(".py") else importlib.import_module(where)
    except Exception as e:  # an engine that does not import cannot be run at this revision
        raise EngineLoadError(f"engine {name!r}: cannot import {where!r}: {type(e).__name__}: {e}") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise EngineLoadError(f"engine {name!r}: {where!r} has no callable {attr!r}")
    return fn


def engine_arithmetic(name: str) -> Arithmetic:
    """What the reference emulates for engine `name` (FSDP2's when the engine declares nothing
    or does not import here: the ranks will report that failure themselves)."""
    try:
        return arithmetic_of(resolve_engine(name))
    except Exception:
        return FSDP2


def _load_file(path: str):
    file = Path(path).resolve()
    if not file.is_file():
        raise FileNotFoundError(f"no such file: {file}")
    mod_name = "fsdp_verify_engine_" + hashlib.sha1(str(file).encode()).hexdigest()[:10]
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[mod_name]
        raise
    return module


__all__ = ["BUILTIN", "Engine", "EngineLoadError", "ShardSpec", "resolve_engine"]
