"""Engines: the sharding layer under test. The training loop is the toolkit's, always the same.

An engine is a callable `NAME(model, mesh, spec) -> nn.Module`, called on every rank after the
model was built identically everywhere. Name one as `fsdp2` (built in), `pkg.module:NAME` or
`path/to/file.py:NAME`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from torch import nn

from fsdp_verify.engines.arithmetic import FSDP2, Arithmetic, arithmetic_of
from fsdp_verify.engines.capabilities import PLAIN, Capabilities, capabilities_of
from fsdp_verify.engines.spec import ShardSpec
from fsdp_verify.imports import import_where

Engine = Callable[..., nn.Module]

BUILTIN = {
    "fsdp2": "fsdp_verify.engines.fsdp2:fully_shard_engine",
    "fsdp1": "fsdp_verify.engines.fsdp1:fsdp1_engine",
    "flat": "fsdp_verify.engines.flat.engine:flat_engine",
}


class EngineLoadError(RuntimeError):
    """The engine string names nothing that can be imported and called."""


def canonical_engine(name: str) -> str:
    """A built-in engine in its one spelling (`FSDP2` -> `fsdp2`); an import path as given."""
    return name.lower() if isinstance(name, str) and name.lower() in BUILTIN else name


def resolve_engine(name: str) -> Engine:
    target = BUILTIN.get(canonical_engine(name), name)
    if not isinstance(target, str) or ":" not in target:
        builtins = ", ".join(repr(b) for b in BUILTIN)
        raise EngineLoadError(f"engine: expected {builtins}, 'pkg.module:NAME' or 'path/file.py:NAME', got {name!r}")
    where, attr = target.rsplit(":", 1)
    try:
        module = import_where(where)
    except Exception as e:  # an engine that does not import cannot be run at this revision
        raise EngineLoadError(f"engine {name!r}: cannot import {where!r}: {type(e).__name__}: {e}") from e
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise EngineLoadError(f"engine {name!r}: {where!r} has no callable {attr!r}")
    try:
        signature = inspect.signature(fn)
    except ValueError:  # no signature to read (a builtin): the call decides
        return fn
    try:  # named here, not as a rank's TypeError mid-case (a model factory passed as the engine)
        signature.bind(None, None, None)
    except TypeError:
        raise EngineLoadError(
            f"engine {name!r}: expected a callable engine(model, mesh, spec) -> module, got {attr}{signature}"
        ) from None
    return fn


def resolve_case_engine(case) -> Engine:
    """The case's engine, refused with a CaseError naming the field where it declares it cannot
    take the case (verify/engines/capabilities.py): in the parent, before any rank starts."""
    engine = resolve_engine(case.engine)
    capabilities_of(engine).refuse(case, case.engine)
    return engine


def engine_capabilities(name: str) -> Capabilities:
    """What engine `name` takes (an engine that declares nothing, or does not import here, takes
    the stable contract only: loading it reports that failure itself)."""
    try:
        return capabilities_of(resolve_engine(name))
    except Exception:
        return PLAIN


def refuse_untakeable(case) -> None:
    """The parent process's check before any rank starts: raises CaseError (exit 2) for a case
    the engine declares it cannot take."""
    engine_capabilities(case.engine).refuse(case, case.engine)


def engine_arithmetic(name: str) -> Arithmetic:
    """What the reference emulates for engine `name` (FSDP2's when the engine declares nothing
    or does not import here: the ranks will report that failure themselves)."""
    try:
        return arithmetic_of(resolve_engine(name))
    except Exception:
        return FSDP2


__all__ = [
    "BUILTIN",
    "Engine",
    "EngineLoadError",
    "ShardSpec",
    "canonical_engine",
    "resolve_case_engine",
    "resolve_engine",
]
