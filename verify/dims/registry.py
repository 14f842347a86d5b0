"""How a dimension package plugs in: what it registers (`DimensionPackage`), where the
registered ones are listed (verify/dims/registered.py, one line each), and the Case's part that
holds their specs (`DimSpecs`, the Case's `dims` field).

A package is everything of one dimension in one folder (verify/dims/float8/: its spec, flags,
draw, how an engine applies it, how the reference emulates it, the loop's hook, the knobs check,
its mutants). The toolkit asks the registered packages, by these hooks, and names none of them:
the Case validates and serialises their specs, the flag table and the draws take their flags and
draw steps, `ShardSpec.convert` applies them on the ranks, the reference converts its model
alike, the loop calls their hook after each optimizer step, the knobs check asks each whether
the engine applied it, the together table takes their rows, and the zoo their mutants.

A package's spec is a frozen dataclass whose default instance means off; a case file holds a
package's spec only when it is on (`"dims": {"float8": {...}}`), so every case without one keeps
the JSON and the hash it had before the package existed.

The torch-free parts (spec, flags, draw) sit in the package's `__init__`; what needs torch sits in
its `runtime` module, imported when a case has the dimension on.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any

from fsdp_verify.validation import CaseError

FIELD = "dims"  # the Case field, and the head of every package field's path ("dims.float8.recipe")


@dataclass(frozen=True)
class DimensionPackage:
    """One dimension, as its package registers it.

    `name`: its key under the Case's `dims`, and the knob an engine declares to take it
    (`Capabilities(takes=("float8",))`: opt-in, as every knob). `spec`: a frozen dataclass, its
    default instance off, with `validate(prefix)` for its own fields. `validate(case, spec)`: what
    it asks of the rest of a case with it on (a CaseError naming the field). `flags`: its rows of
    the flag table (verify/commands/flag.py `Flag`, fields "dims.NAME.FIELD"). `draw(case, pins)`:
    a strategy of cases with it drawn on or off (`pins`: the draw's, its own under "dims.NAME."),
    for an engine that takes it. `not_modelled`: its rows of the together table
    (verify/dims/together.py `NotModelled`). `runtime`: the module with its torch hooks, each
    optional: `convert(model, mesh, spec, case)` on the ranks (`ShardSpec.convert`),
    `convert_reference(model, spec, case)` and `compute_dtypes(model, spec, case)` in the
    reference, `after_optimizer_step(module, spec, case)` in the loop, `applied(model, spec, case)`
    for the knobs check, `built(module, spec, case)` (a JSON record the trace keeps) and
    `all_gather(params, first, built, spec, case)` for the communication contract,
    `gather_metadata(params, first, built, spec, case)` for the memory contract (what an
    all-gather leaves on a unit's parameters until they are copied out: bytes by storage),
    `own_check(spec, case)`: its own check of its arithmetic, from the reference alone. `mutants`: the
    module registering its zoo bugs. `requires`: (module, extra) pairs its runtime imports."""

    name: str
    what: str
    spec: type
    applies: str
    flags: tuple = ()
    validate: Callable[[Any, Any], None] | None = None
    draw: Callable[[Any, dict[str, Any]], Any] | None = None
    not_modelled: tuple = ()
    runtime: str | None = None
    mutants: str | None = None
    docs: str = ""
    # Modules its runtime needs, each with the extra that installs it ("torchao", "float8").
    requires: tuple[tuple[str, str], ...] = ()

    @property
    def off(self) -> Any:
        return self.spec()

    def unavailable(self) -> str | None:
        """Why this installation cannot run it (a module it needs missing), or None."""
        import importlib.util

        for module, extra in self.requires:
            if importlib.util.find_spec(module) is None:
                return f"{module} is not installed (pip install 'fsdp-verify[{extra}]')"
        return None

    def hook(self, name: str) -> Callable | None:
        """The runtime module's function `name`, or None (a hook the package does not need)."""
        if self.runtime is None:
            return None
        return getattr(importlib.import_module(self.runtime), name, None)


# More packages, a user's own, registered by module name, comma-separated: an environment the user
# sets is code the user allowed (a case file naming a package not registered is refused unread).
ENV = "FSDP_VERIFY_DIMS"


@lru_cache(maxsize=1)
def packages() -> tuple[DimensionPackage, ...]:
    """Every registered package, in the order verify/dims/registered.py lists them, then those
    FSDP_VERIFY_DIMS names."""
    registered = importlib.import_module("fsdp_verify.dims.registered")
    extra = tuple(m.strip() for m in os.environ.get(ENV, "").split(",") if m.strip())
    out = []
    for module in registered.PACKAGES + extra:
        package = importlib.import_module(module).PACKAGE
        if not isinstance(package, DimensionPackage):
            raise TypeError(f"{module}.PACKAGE: expected a DimensionPackage, got {type(package).__name__}")
        out.append(package)
    names = [p.name for p in out]
    if len(set(names)) != len(names):
        raise ValueError(f"dimension packages registered twice: {names}")
    return tuple(out)


@lru_cache(maxsize=1)
def by_name() -> dict[str, DimensionPackage]:
    return {p.name: p for p in packages()}


def package_named(name: str) -> DimensionPackage:
    """The registered package `name`; a name no package has is bad input naming `dims.NAME`."""
    known = by_name()
    if name not in known:
        raise CaseError(f"{FIELD}.{name}", f"one of the dimension packages {sorted(known)}", name)
    return known[name]


def on(case) -> Iterator[tuple[DimensionPackage, Any]]:
    """The packages `case` has on, with their specs."""
    known = by_name()
    for name, spec in case.dims.turned_on():
        yield known[name], spec


def call(case, hook: str, *args: Any) -> list[Any]:
    """Hook `hook` of every package `case` has on, called with (*args, spec, case); their results."""
    out = []
    for package, spec in on(case):
        fn = package.hook(hook)
        if fn is not None:
            out.append(fn(*args, spec, case))
    return out


BUILT = "dims_built"  # the trace's meta key: each package's `built` record


def built(case, module) -> dict[str, Any]:
    """Each package on's record of what the engine built (its `built(module, spec, case)` hook,
    JSON: float8's converted modules), which its contract hooks read back from the trace."""
    out = {}
    for package, spec in on(case):
        fn = package.hook("built")
        if fn is not None:
            out[package.name] = fn(module, spec, case)
    return out


def own_checks(case) -> list[Any]:
    """Each package on's own check of its arithmetic, from the reference alone (its
    `own_check(spec, case)` hook: Findings of phase "dims"; float8's products against the rounding
    of their casts)."""
    return [finding for found in call(case, "own_check") for finding in found]


def contributions(case, got, hook: str, *args: Any) -> list[Any]:
    """Hook `hook` of each package on, called with (*args, its built record, spec, case): what it
    adds to a contract (verify/checks/comm.py, verify/checks/memory.py)."""
    records = got.meta.get(BUILT, {})
    out = []
    for package, spec in on(case):
        fn = package.hook(hook)
        if fn is not None:
            out.append(fn(*args, records.get(package.name), spec, case))
    return out


class DimSpecs(Mapping):
    """The Case's `dims`: each registered package's spec, its default (off) where the case sets
    none. Immutable and hashable, as the Case is; `case.dims.float8` reads one spec."""

    __slots__ = ("_specs",)

    def __init__(self, specs: Mapping[str, Any] | None = None):
        given = dict(specs or {})
        for name, spec in given.items():
            kind = package_named(name).spec
            if not isinstance(spec, kind):
                raise CaseError(f"{FIELD}.{name}", f"a {kind.__name__}", spec)
        object.__setattr__(self, "_specs", {n: given.get(n, p.off) for n, p in by_name().items()})

    def __setattr__(self, name: str, value: Any) -> None:
        raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")

    def __getitem__(self, name: str) -> Any:
        return self._specs[name]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # copy and pickle probe before `_specs` exists
            raise AttributeError(name)
        try:
            return self._specs[name]
        except KeyError:
            raise AttributeError(name) from None

    def __reduce__(self):
        return DimSpecs, (self._specs,)

    def __deepcopy__(self, memo: dict) -> DimSpecs:
        return self  # immutable, as its specs are

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DimSpecs) and self._specs == other._specs

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._specs.items())))

    def __repr__(self) -> str:
        return f"DimSpecs({dict(self.turned_on())!r})"

    def turned_on(self) -> Iterator[tuple[str, Any]]:
        """(name, spec) of each package whose spec is not its default."""
        known = by_name()
        return ((n, s) for n, s in self._specs.items() if s != known[n].off)

    def validate(self) -> None:
        for name, spec in self._specs.items():
            spec.validate(f"{FIELD}.{name}")

    @classmethod
    def from_dict(cls, data: Any, build: Callable[[type, Any, str], Any]) -> DimSpecs:
        """From a case file's `dims` object; `build(spec_type, value, path)` builds one spec,
        naming an unknown key by its path (verify/case.py `_build`)."""
        if not isinstance(data, dict):
            raise CaseError(FIELD, "a JSON object of dimension specs", data)
        return cls({n: build(package_named(n).spec, v, f"{FIELD}.{n}") for n, v in data.items()})

    @staticmethod
    def check_value(key: str, value: Any) -> None:
        """Raise the CaseError a package's spec (`key` "float8") or field ("float8.recipe") gets
        for `value` whatever else the case holds (a draw's pin, checked before any draw)."""
        package = key.partition(".")[0]
        DimSpecs().with_(**{key: value})[package].validate(f"{FIELD}.{package}")

    def with_(self, **changes: Any) -> DimSpecs:
        """Specs replaced whole (`float8=Float8Spec(...)`) or by field (`**{"float8.recipe": ...}`)."""
        specs = dict(self._specs)
        for key, value in changes.items():
            name, _, sub = key.partition(".")
            package_named(name)
            specs[name] = replace(specs[name], **{sub: value}) if sub else value
        return DimSpecs(specs)
