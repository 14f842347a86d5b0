"""The bug zoo: injected bugs the toolkit must catch, each a small mutation of a correct FSDP2 run
(verify/zoo/mutants/) drawn from a real report or seed document. `fsdp-verify selftest` draws
cases for each from its pinned strategy and counts how many it takes to catch it.

Pins narrow `fsdp_verify.properties.strategies.cases` to the cases where the bug can show at all (sync only
on the last micro-batch for a bug in that path, clipping on for a clipping bug, two ranks or more
for a reduction bug), never to the cases where it happens to show. Even so, not every case can
expose every bug (a rank that re-initialises but holds no element of any parameter, as when all
widths are 1, changes nothing), which is why the self-test counts the cases it took. Most bugs
are drawn on MLPs only, to keep an example cheap; the tied-weight bug needs the Transformer.

Each bug's entry is registered beside its mutant (`@bug(...)`, verify/zoo/registry.py); this
module gathers them, in the order of the modules below and, within one, of their definitions.
"""

from __future__ import annotations

import importlib

from fsdp_verify.dims.registry import packages
from fsdp_verify.zoo import accelerate, mutants, torchtitan, verl
from fsdp_verify.zoo.registry import MULTI_RANK, ZooBug, entries, registering_modules

__all__ = ["BY_NAME", "MULTI_RANK", "ZOO", "ZooBug"]

# The mutants' modules in the package's order, then the bugs planted around a framework's code,
# then the registered dimension packages' mutants (verify/dims/registry.py).
_DIMENSIONS = [importlib.import_module(p.mutants) for p in packages() if p.mutants is not None]
_MODULES = [module.__name__ for module in (*mutants.MODULES, torchtitan, accelerate, verl, *_DIMENSIONS)]
_unlisted = sorted(set(registering_modules()) - set(_MODULES))
if _unlisted:
    raise ImportError(f"zoo bugs registered in modules the catalogue does not list: {_unlisted}")

ZOO: list[ZooBug] = [bug for module in _MODULES for bug in entries(module)]
BY_NAME = {bug.name: bug for bug in ZOO}
