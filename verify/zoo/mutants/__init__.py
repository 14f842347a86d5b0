"""Deliberately broken engines, written against the plug-in contract. Each is a small mutation
of the correct FSDP2 engine modelled on a real bug report; the toolkit's own tests (and the
self-test) require every one of them to be caught, by the right comparator, at the right place.
Use as `--engine fsdp_verify.zoo.mutants:NAME`.

A module a concern, each mutant's catalogue entry registered beside it (verify/zoo/registry.py);
this package re-exports every public mutant under the one name case files, reports and docs use.
"""

from __future__ import annotations

import inspect

from fsdp_verify.engines.fsdp2 import fully_shard_engine
from fsdp_verify.zoo.mutants import (
    accumulation,
    compiled,
    experts,
    fsdp1_and_flat,
    gradients,
    knobs,
    optimizers,
    ownership,
    pipeline,
    precision,
    resources,
    resume,
    tensor_parallel,
)

# The modules in the zoo's order (the catalogue lists their bugs in it).
MODULES = (
    gradients,
    precision,
    accumulation,
    ownership,
    resources,
    fsdp1_and_flat,
    knobs,
    optimizers,
    resume,
    compiled,
    tensor_parallel,
    experts,
    pipeline,
)


def _reexport() -> list[str]:
    """Every public mutant of the modules, here: a callable one of them defines or makes (not one
    it imports from elsewhere), named as its module binds it (a toolkit callable named
    `fsdp_verify.zoo.mutants:NAME` is one of this package's modules': verify/trust.py)."""
    names: dict[str, str] = {}
    for module in MODULES:
        for name, obj in vars(module).items():
            if (
                name.startswith("_")
                or not callable(obj)
                or not getattr(obj, "__module__", "").startswith(__name__ + ".")
            ):
                continue
            if name in names:
                raise ImportError(f"mutant {name!r} defined in both {names[name]} and {module.__name__}")
            names[name] = module.__name__
            globals()[name] = obj
    return sorted(names)


def _declare_what_fully_shard_engine_takes() -> None:
    """Each mutant above that is a mutation of the built-in FSDP2 engine takes every knob it
    takes (verify/engines/capabilities.py), so the zoo is drawn what `fsdp2` is drawn; those on
    FSDP1 or the flat engine declared their own."""
    for fn in list(globals().values()):
        is_engine = (
            inspect.isfunction(fn) and fn.__module__.startswith(__name__ + ".") and not fn.__name__.startswith("_")
        )
        takes_a_spec = is_engine and list(inspect.signature(fn).parameters) == ["model", "mesh", "spec"]
        if takes_a_spec and not hasattr(fn, "capabilities"):
            fn.capabilities = fully_shard_engine.capabilities


__all__ = _reexport()
_declare_what_fully_shard_engine_takes()
