"""What a zoo bug's catalogue entry is (`ZooBug`) and how a module registers one beside its mutant
(`registrar`), so that a mutant's name, code and entry are written in one place. The catalogue
(verify/zoo/catalog.py) gathers the entries; this module imports no mutant, so the mutant
modules and the catalogue both import it without importing each other."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fsdp_verify.torch_support import COMM_CONTRACT, part_off_note

MULTI_RANK = (2, 3, 4)


@dataclass(frozen=True)
class ZooBug:
    name: str
    engine: str  # "fsdp_verify.zoo.mutants:NAME"
    description: str
    source: str  # the real report or seed it comes from
    catchers: tuple[str, ...]  # phases (or check comparators) expected to catch it
    world_sizes: tuple[int, ...] = MULTI_RANK
    precisions: tuple[str, ...] = ("fp32", "bf16")
    model_kinds: tuple[str, ...] = ("mlp",)
    pins: dict[str, Any] = field(default_factory=dict)
    needs: tuple[str, ...] = ()  # parts of the toolkit a torch may lack (torch_support: ZOO_COMM)
    # A bug around a framework's own code (verify/zoo/torchtitan.py): (framework, its model as
    # `--model` spells it there, the factory's keywords); its case fields come from the
    # framework's preset when the strategy is built, not at import.
    framework: tuple[str, str, tuple[tuple[str, Any], ...]] | None = None

    def off_here(self) -> str | None:
        """Why this torch cannot show the bug (a part it needs is off: its mutant cannot be built,
        or the contract that catches it is off; the framework it is planted in is not
        installed), or None."""
        if self.framework is not None:
            import importlib.util

            if importlib.util.find_spec(self.framework[0]) is None:
                from fsdp_verify.frameworks import FRAMEWORKS

                return f"{self.framework[0]} is not installed ({FRAMEWORKS[self.framework[0]]})"
        for key in self.pins:  # a dimension package's bug (verify/dims/registry.py): its modules installed
            head, _, rest = key.partition(".")
            if head == "dims":
                from fsdp_verify.dims.registry import by_name

                missing = by_name()[rest.partition(".")[0]].unavailable()
                if missing is not None:
                    return missing
        needs = self.needs + ((COMM_CONTRACT,) if "comm" in self.catchers else ())
        return next((why for why in map(part_off_note, needs) if why), None)

    def strategy(self, world_sizes: tuple[int, ...] | None = None):
        """The pinned case strategy; `world_sizes` narrows the bug's own (e.g. to 2 in CI)."""
        from fsdp_verify.properties.strategies import cases

        sizes = tuple(w for w in self.world_sizes if world_sizes is None or w in world_sizes)
        if not sizes:
            raise ValueError(f"{self.name}: none of world sizes {world_sizes} can show it (needs {self.world_sizes})")
        pins = dict(self.pins)
        if self.framework is not None:
            from fsdp_verify.frameworks import preset

            name, model, kwargs = self.framework
            tp, pp = (isinstance(pins.get(d), int) and pins[d] > 1 for d in ("tp", "pp"))  # a bug in its tp or pp
            fields = preset(name, model, dict(kwargs), tp=tp, pp=pp)
            pins = {**{k: v for k, v in fields.items() if k != "engine"}, **pins}
        return cases(
            engine=self.engine,
            world_sizes=sizes,
            precisions=self.precisions,
            model_kinds=self.model_kinds,
            **pins,
        )


# The package whose modules' mutants it re-exports: an engine defined in one of those modules is
# named through it (`fsdp_verify.zoo.mutants:NAME`), as case files, reports and docs name it.
MUTANTS = "fsdp_verify.zoo.mutants"

E = TypeVar("E", bound=Callable)

# The entries each module registered, in the order it registered them (by the module's name).
_ENTRIES: dict[str, list[ZooBug]] = {}


def registrar(module: str) -> Callable[..., Callable[[E], E]]:
    """The `bug` decorator of `module` (`bug = registrar(__name__)`): `@bug(description, source,
    catchers, **fields)` on a mutant registers its `ZooBug`, named as the function and engined by
    the import path case files use (`fsdp_verify.zoo.mutants:NAME` for a module of that package,
    else `MODULE:NAME`); `name=` names an engine a factory made (its own `__name__` is the
    factory's). The decorator returns the mutant unchanged."""
    where = MUTANTS if module.startswith(MUTANTS + ".") else module

    def bug(description: str, source: str, catchers: tuple[str, ...], *, name: str | None = None, **fields: Any):
        def register(engine: E) -> E:
            called = name or engine.__name__
            entry = ZooBug(called, f"{where}:{called}", description, source, catchers, **fields)
            known = {b.name: b for bugs in _ENTRIES.values() for b in bugs}
            if called in known and known[called].engine != entry.engine:
                raise ValueError(f"zoo bug {called!r} registered twice: {known[called].engine}, {entry.engine}")
            mine = _ENTRIES.setdefault(module, [])
            mine[:] = [b for b in mine if b.name != called] + [entry]  # a module imported again
            return engine

        return register

    return bug


def entries(module: str) -> list[ZooBug]:
    """The entries `module` registered, in the order it registered them."""
    return list(_ENTRIES.get(module, ()))


def registering_modules() -> list[str]:
    """Every module that registered an entry."""
    return list(_ENTRIES)
