"""Contracts: which of the resource contracts (communication, memory) an engine is held to, as
it declares them, the way it declares its arithmetic (verify/engines/arithmetic.py).

The communication and memory models (verify/checks/comm.py, verify/checks/memory.py) are
FSDP2's: per unit, an all-gather of its Shard(0)-padded parameters, a reduce-scatter of their
gradients, sharded state of 1/shard-group-size each. An engine that shards otherwise (FSDP1's
and the flat engine's one FlatParameter per unit, aligned and padded as a whole) states that
those models do not describe it, `fn.contracts = Contracts(comm=False, memory=False, why=...)`,
and the checks say `n/a` with its reason instead of a finding. An engine that declares nothing
is held to FSDP2's models, as it is emulated with FSDP2's arithmetic.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass


@dataclass(frozen=True)
class Contracts:
    comm: bool = True  # held to FSDP2's communication model
    memory: bool = True  # held to FSDP2's memory model
    why: str = ""  # why not, when either is off


FSDP2 = Contracts()


def engine_contracts(name: str) -> Contracts:
    """What engine `name` is held to (FSDP2's models when it declares nothing or does not import
    here: the ranks will report that failure themselves)."""
    from fsdp_verify.engines import resolve_engine

    try:
        declared = getattr(resolve_engine(name), "contracts", None)
    except Exception:
        return FSDP2
    return declared if isinstance(declared, Contracts) else FSDP2


USER_STEP = Contracts(
    comm=False,
    memory=False,
    why="a user's step (--step) issues collectives and holds tensors of its own (a loss all-reduced for"
    " logging, a gradient kept for a metric); the models describe the toolkit's loop",
)


# The trace's meta key for the modules the engine wrapped in `checkpoint_wrapper` itself (by
# their original names), recorded by the loop from the module the engine returned.
ENGINE_CHECKPOINTED = "engine_checkpointed"


def as_run(case, got=None):
    """The case as the contracts read it: checkpointed where the engine checkpointed modules on
    its own though the case did not ask (a plug-in's `apply_activation_checkpointing` before
    `fully_shard`, as most training scripts do). Their recomputation runs forwards again inside
    backward, which the models describe only under checkpointing (a fresh-seed fuzz of such a
    plug-in, seed 5001, met "16 B of unsharded parameters alive after forward" of a unit nested in
    a checkpointed one: the memory model's false alarm). A copy that is not validated again: the
    case ran as it is."""
    if case.activation_checkpointing or got is None or not got.meta.get(ENGINE_CHECKPOINTED):
        return case
    run = copy.copy(case)
    object.__setattr__(run, "activation_checkpointing", True)
    return run


def case_contracts(case, got=None) -> Contracts:
    """What a case is held to (_held_to), less the communication contract on a torch that lacks
    what its probe needs (torch_support.COMM_CONTRACT: the verdict says n/a and why). `got`: the
    sharded trace, for what the engine built (`as_run`)."""
    from fsdp_verify.torch_support import COMM_CONTRACT, part_off_note

    held = _held_to(as_run(case, got))
    why = part_off_note(COMM_CONTRACT)
    if why and held.comm:
        return Contracts(comm=False, memory=held.memory, why="; ".join(w for w in (held.why, why) if w))
    return held


def _held_to(case) -> Contracts:
    """Its engine's declaration, none around a user's own step, and no memory model under
    activation checkpointing (not modelled: with a checkpointed unit nested in another, the inner
    unit's unsharded parameters were measured alive after its forward, 128 B over the plan on a
    fresh-seed sweep; the communication model still holds there)."""
    if getattr(case, "step", None) is not None:
        return USER_STEP
    declared = engine_contracts(case.engine)
    if case.parallel.pp > 1 and (declared.comm or declared.memory):
        # The stages' sends and receives, and a stage's units held unsharded across its
        # micro-batches (the schedule turns resharding after backward off): not modelled yet.
        why = (
            "pipeline parallelism's point-to-point sends and a stage's unsharded accumulation are not in the contracts"
        )
        return Contracts(comm=False, memory=False, why="; ".join(w for w in (declared.why, why) if w))
    if case.parallel.ep > 1 and (declared.comm or declared.memory):
        # The token dispatch's all-to-alls carry as many rows as the routing sends each rank, and
        # the experts' shards sit on two meshes (efsdp, ep): neither model describes them yet.
        why = (
            "expert parallelism's all-to-all dispatch and the experts' shards over the ep mesh are not in the contracts"
        )
        return Contracts(comm=False, memory=False, why="; ".join(w for w in (declared.why, why) if w))
    if getattr(case, "prefetch", None) is not None and (declared.comm or declared.memory):
        # Explicit prefetching is modelled on the built-in models' run order and knobs measured
        # with it; the closing sweeps (seeds 20263951-3) had 16 contract false alarms outside that:
        # a user's model whose modules run out of registration order (tiny Llama: 11 of 200),
        # prefetch beside `reshard_after_backward_last` (4 of 500) and a checkpointed recompute
        # (1 of 300 resume cases), then frozen units (2 of 500, seed 20263971). Numbers are still
        # compared.
        why = None
        if case.model.is_custom:
            why = "explicit prefetching of a user's model is not in the contracts (its run order is not known)"
        elif getattr(case, "reshard_after_backward_last", False):
            why = "explicit prefetching beside reshard_after_backward_last is not in the contracts"
        elif case.model.frozen:
            # a unit no backward runs through, reached by a forward list: an all-gather the plan
            # does not account for (the closing sweep's 5017026ac73e, seed 20263971; not modelled)
            why = "explicit prefetching with frozen parameters is not in the contracts"
        elif getattr(case, "activation_checkpointing", False):
            # a recompute may re-issue a unit's forward list, or not (fca52d9137dc; the resume
            # sweep's d8417f0295bc, seed 20263953): not modelled
            why = "explicit prefetching under activation checkpointing is not in the contracts"
        if why is not None:
            return Contracts(comm=False, memory=False, why="; ".join(w for w in (declared.why, why) if w))
    routed = routing_decides_backward(case)
    if routed and (declared.comm or declared.memory):
        return Contracts(comm=False, memory=False, why="; ".join(w for w in (declared.why, routed) if w))
    if getattr(case, "activation_checkpointing", False) and declared.memory:
        why = "activation checkpointing is not in the memory model"
        return Contracts(comm=declared.comm, memory=False, why="; ".join(w for w in (declared.why, why) if w))
    return declared


def routing_decides_backward(case) -> str | None:
    """Why the contracts' unit facts do not hold for every micro-batch, or None. Which units
    backward runs through is measured once (the run's first micro-batch, `forward_facts`) and
    is the same for every micro-batch and rank when it depends on the parameters only. It
    depends on the data when the built-in MLP's routed experts see an input that needs no
    gradient (the block before them frozen), their gate is frozen, and some experts train while
    others are frozen: the experts' unit needs a gradient only in a micro-batch that routes a
    sample to a trainable expert, so its backward, and the all-gather its implicit prefetch
    issues, come and go with the routing (measured, torch 2.13: fuzz seed 20270206, case
    dd9281d47026, shrunk to tests/regressions/64ef022a247b.json: rank 2's second micro-batch
    routed nothing to the one trainable expert and FSDP2 issued no backward all-gather of
    `layers.0.linear`). Not modelled: the numbers are still compared."""
    from fsdp_verify.models import is_frozen, parameter_names

    spec = case.model
    if not getattr(spec, "experts", 0) or not spec.frozen:
        return None
    names = parameter_names(spec)

    def frozen(prefix: str) -> bool:
        return all(is_frozen(spec, n) for n in names if n.startswith(prefix))

    experts = [frozen(f"moe.experts.{e}.") for e in range(spec.experts)]
    if frozen("layers.0.") and frozen("moe.gate.") and any(experts) and not all(experts):
        return (
            "whether backward runs through the routed experts' unit depends on each micro-batch's routing"
            " (frozen block before them, frozen gate, frozen experts beside trainable ones): not in the contracts"
        )
    return None
