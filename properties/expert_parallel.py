"""Routed experts and expert parallelism's draw step: the grouped experts' fields, the ep degrees
a shard group takes (beside reference/expert_parallel.py, its emulation)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from hypothesis import assume
from hypothesis import strategies as st

from fsdp_verify.case import Case, CaseError
from fsdp_verify.dims.together import drawn_off, pinned_beside
from fsdp_verify.engines.expert_parallel import experts_of
from fsdp_verify.properties.model_draws import ordered_units
from fsdp_verify.properties.pins import asked, pinned

GROUPED_FIELDS = ("model.top_k", "model.capacity_factor", "model.aux_loss", "model.router_bias")
# What asks for each composition's draw: a pin of one of these fields to anything but its value
# when off (a strategy counts as asking). Unasked, the composition draws nothing at all, so a
# seed draws the cases it drew before it existed (as tp and compile: drawn where asked).
ASKS_GROUPED = {
    "ep": 1,
    "model.top_k": None,
    "model.capacity_factor": None,
    "model.aux_loss": 0.0,
    "model.router_bias": 0.0,
}


@st.composite
def grouped_experts(draw: Callable, case: Case, pins: dict[str, Any]) -> Case:
    """`case`'s routed experts as grouped experts (verify/models/moe.py: top-k, capacity, the
    load-balancing loss, the router bias) and sharded over an ep dim (docs/expert-parallel.md),
    drawn after everything else and only where asked (`ASKS_GROUPED`: `--ep`, `--top-k`, ...),
    so that a seed's draws stay what they were. Only where routed experts were drawn, so only for an engine that takes them (`experts`); an ep degree
    only for one that takes `ep` (`_knob_pins` pins it to 1 otherwise). Beside ep > 1, what the
    reference does not model there yet is drawn off (a clip, Shard(1) placements, offload)."""
    model = case.model
    if not asked(pins, ASKS_GROUPED):
        return case
    if model.is_custom and case.resume_after is None and experts_of(model):
        assume(all(pins.get(name) in (None, 0, 0.0) for name in GROUPED_FIELDS))  # the built-in MLP's
        return draw(own_experts_parallel(case, pins))
    if not model.experts or model.kind != "mlp" or case.resume_after is not None:
        assume(all(pins.get(name) in (None, 0, 0.0) for name in GROUPED_FIELDS) and pins.get("ep", 1) == 1)
        return case
    top_k = draw(pinned(pins, "model.top_k", st.one_of(st.none(), st.integers(1, min(2, model.experts)))))
    if top_k is not None and "model.experts" not in pins:
        # four experts too: what ep degrees of 2 and 4 divide (the loop's draw offers 2 and 3)
        model = replace(model, experts=draw(st.sampled_from(sorted({model.experts, 4}))))
    if top_k is None:
        assume(all(pins.get(name) in (None, 0, 0.0) for name in GROUPED_FIELDS[1:]) and pins.get("ep", 1) == 1)
        return case
    # The aux loss's gradient is added unscaled (DeepSeek's AddAuxiliaryLoss): Case refuses it
    # beside a loss divided by the world size or multiplied by a loss scale.
    aux_takes = case.grad_reduction == "avg" and case.loss_scaling is None
    grouped = replace(
        model,
        top_k=top_k,
        capacity_factor=draw(pinned(pins, "model.capacity_factor", st.sampled_from((None, 0.5, 1.0, 1.5)))),
        aux_loss=draw(pinned(pins, "model.aux_loss", st.sampled_from((0.0, 0.01, 0.1) if aux_takes else (0.0,)))),
        # a checkpointed forward would count its assignments twice (Case refuses it)
        router_bias=draw(
            pinned(pins, "model.router_bias", st.sampled_from((0.0,) if case.activation_checkpointing else (0.0, 0.01)))
        ),
        # the per-expert loop's parameter names mean nothing to the grouped experts
        frozen=tuple(f for f in model.frozen if not f.startswith("moe.experts.")),
    )
    # ep > 1 turns off what is not modelled beside it, unless a pin asked for it
    pinned_on = pinned_beside("ep", case, pins)
    degrees = (
        [] if pinned_on else ep_degrees(case, [grouped.experts])
    )  # half the draws parallel where any fits; shrinks to 1
    ep = draw(pinned(pins, "ep", st.one_of(st.just(1), st.sampled_from(degrees)) if degrees else st.just(1)))
    changes: dict[str, Any] = {"model": grouped, "ep": ep}
    if not grouped.frozen:
        changes["unfreeze_step"] = None
    if ep > 1:
        changes.update(drawn_off("ep"))
        if case.wrap is not None and "moe.experts" not in case.wrap_plan:
            changes["wrap"] = ordered_units(set(case.wrap_plan[:-1]) | {"moe.experts"})
    try:
        return case.with_(**changes)
    except CaseError:
        assume(False)
        raise


@st.composite
def own_experts_parallel(draw: Callable, case: Case, pins: dict[str, Any]) -> Case:
    """A model's own grouped experts (torchtitan's MoE: verify/models/moe.py `experts_held`)
    sharded over an ep dim half the time where a degree fits, what is not modelled beside it
    drawn off; its routing is the model's own, so nothing else of it is drawn."""
    counts = sorted(set(experts_of(case.model).values()))
    degrees = [] if pinned_beside("ep", case, pins) else ep_degrees(case, counts)
    ep = draw(pinned(pins, "ep", st.one_of(st.just(1), st.sampled_from(degrees)) if degrees else st.just(1)))
    changes: dict[str, Any] = {"ep": ep, **(drawn_off("ep") if ep > 1 else {})}
    try:
        return case.with_(**changes)
    except CaseError:
        assume(False)
        raise


def ep_degrees(case: Case, counts: list[int], shard: int | None = None) -> list[int]:
    """Every degree above 1 that divides each experts module's count and the shard dim (the
    case's, or `shard`); not the whole shard dim under an fp16 reduction (Case refuses it: FSDP2
    divides twice over a group of one)."""
    shard = shard or case.mesh[-1]
    fp16 = (case.precision.reduce_dtype or case.precision.param_dtype) == "fp16"
    return [
        d
        for d in range(2, shard + 1)
        if shard % d == 0 and all(n % d == 0 for n in counts) and not (fp16 and d == shard)
    ]


def routing_never_decides_what_requires_grad(case: Case) -> Case:
    """`case` with the routed experts' gate trainable where the routing would decide whether the
    layer after the experts gets an input that requires grad (`routing_decides_requires_grad`:
    torch 2.13's FSDP2 then orders its reduce-scatters by the routing,
    tests/upstream/test_fsdp2_unused_params_reduce_order.py, a strict xfail; `check` catches it as
    a rank crash and names it): not drawn (sweep seed 5011 drew it, 1 of 100). A trainable gate
    scales every reached expert's output, so that input always requires grad."""
    from fsdp_verify.engines.routed_reduction import routing_decides_requires_grad
    from fsdp_verify.models import is_frozen, parameter_names

    model = case.model
    if not routing_decides_requires_grad(model):
        return case
    names = parameter_names(model)  # by name: a prefix may cover the gate
    frozen = tuple(n for n in names if is_frozen(model, n) and not n.startswith("moe.gate."))
    return case.with_(model=replace(model, frozen=frozen))


def checkpointed_blocks_recomputed(case: Case) -> Case:
    """`case` with its first parameter (a decoder's embedding) trainable where a model's own
    grouped experts (torchtitan's MoE) train under activation checkpointing with it frozen: a
    checkpointed block whose parameters and input need no gradient is never recomputed, and
    torchtitan's load balancing halves its counts all the same, as if it had been (a torchtitan
    bug: tests/upstream/test_torchtitan_load_balancing_halves_counts_nothing_recomputed.py, a
    strict xfail; `check` reports it at the expert bias): not drawn (sweep 9402: 2 of 80)."""
    from fsdp_verify.models import is_frozen, parameter_names

    model = case.model
    if not (case.activation_checkpointing and model.is_custom and model.frozen and experts_of(model)):
        return case
    names = parameter_names(model)
    if not names or not is_frozen(model, names[0]):
        return case
    frozen = tuple(n for n in names if is_frozen(model, n) and n != names[0])
    return case.with_(model=replace(model, frozen=frozen), **({} if frozen else {"unfreeze_step": None}))
