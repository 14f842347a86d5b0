"""Explicit prefetching (`prefetch`, issue 28 item 3): which units each FSDP2 unit unshards early,
as `FSDPModule.set_modules_to_forward_prefetch` / `set_modules_to_backward_prefetch` take them
(torchtitan's recipe, generalised to k units ahead).

One pure function of the wrap plan and the model's parameter names, so the engine that sets the
lists and the contracts that model them (verify/checks/comm.py, memory.py) derive the same ones:

- forward order: the units in the order their pre-forward hooks run, taken as the modules'
  registration order (a parent before its children; a unit's place is its first parameter's,
  the root first). Each unit's forward list: the next k units in it.
- backward order: the reverse of FSDP2's *post-forward* order (what its implicit backward
  prefetch walks, `FSDPParamGroup._backward_prefetch`): the post-order of the same tree, so the
  root first, then the last unit. Each unit's backward list: the next k units in it.

Only units that own a parameter FSDP2 manages take part: a unit without one (none of its own,
or only `ignored` ones) has no parameter group, so `_prefetch_unshard` would skip it and it would
only waste one of the k places (a fresh-seed find: a whole unit ignored beside `prefetch`, the
memory contract then counted the unit before it as copied out last where it was). The last unit in
backward order gets an empty list, so FSDP2 falls back to its implicit prefetch there (its
predecessor in post-forward order: none).
"""

from __future__ import annotations

from collections.abc import Sequence


def forward_order(units: Sequence[str], param_names: Sequence[str], ignored: Sequence[str] = ()) -> list[str]:
    """Units that own a managed parameter (not one of the `ignored` prefixes), in pre-forward
    order (registration order, parents first)."""
    from fsdp_verify.models import is_ignored
    from fsdp_verify.units import owner_of_param as owning_unit

    param_names = [n for n in param_names if not is_ignored(tuple(ignored), n)]
    owning = {owning_unit(tuple(units), n) for n in param_names} & set(units)
    first: dict[str, int] = {}
    for i, n in enumerate(param_names):
        for u in units:
            if u == "" or n == u or n.startswith(u + "."):
                first.setdefault(u, i)
    return sorted((u for u in owning if u in first), key=lambda u: (first[u], u.count(".") + (u != "")))


def _is_ancestor(a: str, b: str) -> bool:
    return a != b and (a == "" or b.startswith(a + "."))


def post_forward_order(forward: Sequence[str]) -> list[str]:
    """The order forwards finish in: a unit after every unit nested in it (post-order)."""
    out: list[str] = []
    stack: list[str] = []
    for u in forward:
        while stack and not _is_ancestor(stack[-1], u):
            out.append(stack.pop())
        stack.append(u)
    out.extend(reversed(stack))
    return out


def prefetch_lists(
    units: Sequence[str], param_names: Sequence[str], k: int, ignored: Sequence[str] = ()
) -> dict[str, tuple[list[str], list[str]]]:
    """Unit -> (forward list, backward list), each the next k units in that pass's order."""
    fwd = forward_order(units, param_names, ignored)
    bwd = list(reversed(post_forward_order(fwd)))
    out: dict[str, tuple[list[str], list[str]]] = {}
    for u in fwd:
        i, j = fwd.index(u), bwd.index(u)
        out[u] = (fwd[i + 1 : i + 1 + k], bwd[j + 1 : j + 1 + k])
    return out


def set_prefetching(
    model, units: Sequence[str], k: int, forward_k: int | None = None, ignored: Sequence[str] = ()
) -> None:
    """Set each unit's explicit lists on the FSDP2 modules (after every unit is sharded);
    `forward_k`: the forward lists' length, if not k (the zoo's off-by-one)."""
    from fsdp_verify.units import modules_of

    names = [n for n, _ in model.named_parameters()]
    forward = prefetch_lists(units, names, forward_k or k, ignored)
    for unit, (_fwd, bwd) in prefetch_lists(units, names, k, ignored).items():
        fwd = forward[unit][0]
        module = modules_of(model, unit)[0]  # a group's modules share one state
        if fwd:
            module.set_modules_to_forward_prefetch([modules_of(model, v)[0] for v in fwd])
        if bwd:
            module.set_modules_to_backward_prefetch([modules_of(model, v)[0] for v in bwd])
