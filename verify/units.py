"""Shard units: what one `fully_shard` call covers, named in a wrap plan.

A unit is one module (its FQN, the root "") or, as FSDP2's `fully_shard([norm, lm_head])` makes
it, one unit over several modules: spelled with `+` between their FQNs ("norm+lm_head"), in the
order given to `fully_shard`. Such a unit owns the parameters of every member (one all-gather and
one reduce-scatter for all of them), runs its pre-forward at the first member's forward and its
post-forward after the last (torch's `_register_group_forward_hooks`). torchtitan shards its
`[norm, lm_head]` (and, with tied weights, `[tok_embeddings, norm, lm_head]`) so.

Everything that asks which unit owns a parameter, or whether one unit sits inside another, asks
here, so that a group is one unit everywhere.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

SEPARATOR = "+"


def members(unit: str) -> tuple[str, ...]:
    """The module FQNs a unit covers: ("norm", "lm_head") for "norm+lm_head", ("",) for the root."""
    return tuple(unit.split(SEPARATOR)) if SEPARATOR in unit else (unit,)


def group(modules: Iterable[str]) -> str:
    """The unit over these modules, in the order given."""
    return SEPARATOR.join(modules)


def is_group(unit: str) -> bool:
    return SEPARATOR in unit


def is_block(unit: str) -> bool:
    """A unit whose name's last part is a number: an element of a ModuleList or Sequential
    ("layers.3"), or of a ModuleDict keyed by numbers (torchtitan's `layers`, keyed "0", "1", ...):
    a repeated block, what torchtitan compiles one by one (`compile: blocks`,
    verify/training/compile.py). A dict keyed by names holds no blocks by this rule."""
    return bool(unit) and not is_group(unit) and unit.rsplit(".", 1)[-1].isdigit()


def is_ancestor(parent: str, child: str) -> bool:
    """Module FQN `parent` strictly contains module `child` (the root contains everything)."""
    return parent != child and (parent == "" or child.startswith(parent + "."))


def covers(unit: str, module: str) -> bool:
    """`module` is one of the unit's members or inside one."""
    return any(m == module or is_ancestor(m, module) for m in members(unit))


def depth(unit: str, module: str) -> int:
    """How deep the member of `unit` that holds `module` sits (-1: none does): the innermost unit
    owns a parameter."""
    return max((len(m) + 1 for m in members(unit) if m == module or is_ancestor(m, module)), default=-1)


def owner_of_module(plan: Iterable[str], module: str) -> str | None:
    """The innermost unit of `plan` covering module `module`, or None."""
    best, best_depth = None, -1
    for unit in plan:
        d = depth(unit, module)
        if d > best_depth:
            best, best_depth = unit, d
    return best


def owner_of_param(plan: Iterable[str], param: str) -> str:
    """The unit owning parameter `param` (the root "" at worst)."""
    module = param.rsplit(".", 1)[0] if "." in param else ""
    found = owner_of_module(plan, module)
    return "" if found is None else found


def inside(inner: str, outer: str) -> bool:
    """Every member of `inner` sits inside some member of `outer` (a unit nested in another)."""
    return inner != outer and all(any(is_ancestor(o, m) for o in members(outer)) for m in members(inner))


def modules_of(model: nn.Module, unit: str) -> list[nn.Module]:
    """The unit's modules in `model`, in the unit's order (what `fully_shard` is given)."""
    return [model.get_submodule(m) for m in members(unit)]


def modules_here(model: nn.Module, unit: str) -> list[nn.Module]:
    """`modules_of`, or [] where a member is not in `model`: a pipeline rank's copy of the model
    that another stage's modules were deleted from (torchtitan's `_split_module` sets them None)."""
    try:
        modules = modules_of(model, unit)
    except AttributeError:
        return []
    return modules if all(isinstance(m, nn.Module) for m in modules) else []
