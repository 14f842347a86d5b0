"""FSDP2 units over several sibling modules (`fully_shard([a, b])`): the groups a model offers and
the draw step that puts one in a wrap plan."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hypothesis import strategies as st

from fsdp_verify import units
from fsdp_verify.case import Case, CaseError


def group_candidates(case: Case) -> list[tuple[str, ...]]:
    """Units of the plan that one `fully_shard([...])` could cover instead (verify/units.py):
    runs of two or more sibling units next to each other in the model's order (an MLP's blocks,
    a Transformer's `norm` and `output`), and, with tied embeddings, torchtitan's
    `[tok_embeddings, norm, output]` (its tied unit) where the root holds them."""
    from fsdp_verify.models import module_classes

    order = {name: i for i, name in enumerate(module_classes(case.model))}
    plain = sorted((u for u in case.wrap_plan if u and not units.is_group(u)), key=lambda u: order.get(u, -1))
    out: list[tuple[str, ...]] = []
    for i, first in enumerate(plain):
        parent = first.rpartition(".")[0]
        run = [first]
        for later in plain[i + 1 :]:
            between = [
                n for n in order if order[run[-1]] < order[n] < order[later] and not units.is_ancestor(run[-1], n)
            ]
            if later.rpartition(".")[0] != parent or between:
                break
            run.append(later)
            out.append(tuple(run))
    if case.model.kind == "transformer" and case.model.tie_embeddings and "norm" in order:
        root_holds = units.owner_of_module(case.wrap_plan, "tok_embeddings") == ""
        if root_holds:
            out.append(
                ("tok_embeddings", "norm", "output") if "norm" not in case.wrap_plan else ("tok_embeddings", "output")
            )
    return out


@st.composite
def unit_groups(draw: Callable, case: Case, pins: dict[str, Any]) -> Case:
    """`case` with one unit over several modules in a third of the draws where the plan has
    candidates (`group_candidates`), for an engine that takes `groups`; drawn after everything
    else, so that a seed's earlier draws stay what they were. Not beside ep or prefetch (the
    Case refuses those), nor where the plan was pinned; under pp a group across two stages is
    refused by the Case, and the draw keeps the plan as it was."""
    if "wrap" in pins or case.ep > 1 or case.prefetch is not None:
        return case
    candidates = group_candidates(case)
    if not candidates or draw(st.integers(0, 2)) != 0:
        return case
    chosen = draw(st.sampled_from(candidates))
    last = max(i for i, u in enumerate(case.wrap_plan) if u in chosen) if set(chosen) <= set(case.wrap_plan) else None
    plan = []
    for i, u in enumerate(case.wrap_plan):  # the group where its last member stood: children still first
        if u == "" and last is None or i == last:
            plan.append(units.group(chosen))
        if u not in chosen:
            plan.append(u)
    try:
        return case.with_(wrap=tuple(plan))
    except CaseError:
        return case
