"""The cases FSDP1 can express and the reference models (`fsdp1_modelled`): the fsdp1 engine's draw
keeps to them."""

from __future__ import annotations

from fsdp_verify.case import Case


def _units_frozen_whole(case: Case) -> set[str]:
    """The units of the plan ("" the root) that own parameters, every one of them frozen."""
    from fsdp_verify.models import is_frozen, parameter_names
    from fsdp_verify.units import owner_of_module

    own: dict[str, list[str]] = {}
    for n in parameter_names(case.model):
        own.setdefault(owner_of_module(case.wrap_plan, n.rpartition(".")[0]) or "", []).append(n)
    return {u for u, names in own.items() if all(is_frozen(case.model, n) for n in names)}


def _root_unit_frozen_whole(case: Case) -> bool:
    """Whether the root unit owns parameters and every one of them is frozen."""
    return "" in _units_frozen_whole(case)


def fsdp1_modelled(case: Case) -> bool:
    """False for the FSDP1 behaviour the reference does not model and the cases FSDP1 cannot run
    (strict xfails in tests/test_engine_fsdp1.py, docs/engines.md "FSDP1"): a no-sync case whose bf16
    compute differs from an fp32 reduce_dtype (FSDP1 accumulates in param_dtype); and under
    NO_SHARD (a shard group of one: world size 1 or a (W, 1) mesh) a frozen tied weight with
    nested units and a second forward, of the next micro-batch or the next step (FSDP1's own
    assertion `as_params=True type(prim_param)=Tensor` there), or a no-sync micro-batch in a
    low-precision param_dtype (FSDP1 assigns the bf16 accumulated gradient's views to the fp32
    parameters in the next forward and torch 2.13 refuses, grad_dtype: seen with tied embeddings,
    every such case left out); and under NO_SHARD, a parameter unfrozen mid-run where FSDP1 loses
    its gradient, two PyTorch bugs: with no-sync micro-batches it drops the accumulated gradient
    (tests/upstream/test_fsdp1_no_shard_no_sync_unfrozen_param.py), and a root unit whose own
    parameters were all frozen through a forward never trains again (its original parameters stay
    unregistered, the gradient lands on a plain view the optimizer does not hold: regression
    4e6cbe2adeff, tests/upstream/test_fsdp1_no_shard_unfrozen_root_unit.py). Other NO_SHARD
    unfreezes are drawn. And under NO_SHARD, a checkpoint of a model whose root unit's own
    parameters are all frozen: the same unregistered parameters make `state_dict()` assert
    (tests/upstream/test_fsdp1_no_shard_frozen_root_state_dict.py, regression 6623a1f52a02), and
    so does a checkpoint with a non-root unit frozen whole (regression 27731e33e8e1: `moe`, its
    gate a unit of its own; fuzz seed 20270213), so every NO_SHARD resume with a unit frozen whole
    is left out."""
    p = case.precision
    if case.mesh[-1] == 1 and case.unfreeze_step is not None:
        no_sync = case.microbatches > 1 and not case.sync_every_microbatch
        if no_sync or _root_unit_frozen_whole(case):
            return False
    if case.mesh[-1] == 1 and case.resume_after is not None and _units_frozen_whole(case):
        return False
    low_params = p.param_dtype not in (None, "fp32")
    if case.mesh[-1] == 1 and low_params and case.microbatches > 1 and not case.sync_every_microbatch:
        return False
    m = case.model
    frozen_tie = (
        m.kind == "transformer"
        and m.tie_embeddings
        and any(n.startswith(f) for f in m.frozen for n in ("tok_embeddings.weight", "output.weight"))
    )
    second_forward = case.microbatches > 1 or case.steps > 1
    if case.mesh[-1] == 1 and second_forward and frozen_tie and len(case.wrap_plan) > 1:
        return False
    return case.sync_every_microbatch or p.param_dtype in (None, "fp32") or p.reduce_dtype in (None, p.param_dtype)
