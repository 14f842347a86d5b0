"""A plug-in that wraps modules before sharding, as most FSDP2 scripts do with PyTorch's
`apply_activation_checkpointing` (torchtitan with its own policies): each wrapped module's
parameters gain a `_checkpoint_wrapped_module.` segment that the reference's model, which no
engine touched, does not have. Before the names were read through the wrappers
(verify/module_names.py) every such parameter was "not a parameter of the reference model"; and
a checkpointed unit nested in another, which the case did not say was checkpointed, was held to
the memory model of an uncheckpointed run (the contracts now read what the engine built:
verify/engines/contracts.py `as_run`)."""

from __future__ import annotations

import pytest
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from fsdp_verify import module_names
from fsdp_verify.case import Case, ModelSpec
from fsdp_verify.case_specs import DataSpec
from fsdp_verify.engines.contracts import ENGINE_CHECKPOINTED, as_run, case_contracts
from fsdp_verify.trace import Trace
from fsdp_verify.training.checkpointing import checkpoint_wrapped

WRAPPED = "tests/engines/checkpoint_wrapped.py:shard"
WITHOUT_RNG_STATE = "tests/engines/checkpoint_wrapped.py:without_rng_state"
LM = ModelSpec(kind="transformer", vocab_size=32, dim=16, n_layers=2, n_heads=2, ffn_hidden=24, seq_len=4)


def test_names_are_read_through_the_wrappers_and_a_wrapper_keeps_its_modules_name():
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)))
    model[1] = checkpoint_wrapper(model[1])
    raw = [n for n, _ in model.named_parameters()]
    assert raw[2] == "1._checkpoint_wrapped_module.0.weight", raw
    assert [n for n, _ in module_names.named_parameters(model)] == ["0.weight", "0.bias", "1.0.weight", "1.0.bias"]
    modules = dict(module_names.named_modules(model))
    assert list(modules) == ["", "0", "1", "1.0"]
    assert modules["1"] is model[1]  # the wrapper, which fully_shard and the hooks see, not the module inside
    assert checkpoint_wrapped(model) == ["1"]
    assert model.get_submodule("1.0") is model[1]._checkpoint_wrapped_module[0]  # lookups reach through already
    assert module_names.original("_orig_mod.layers.0._fsdp_wrapped_module.w") == "layers.0.w"


def _case(world: int, engine: str, **changes) -> Case:
    return Case(model=LM, world_size=world, steps=2, data=DataSpec(batch_size=2 * world), engine=engine).with_(
        **changes
    )


@pytest.mark.parametrize("world, mesh", [(2, None), (4, (2, 2))], ids=["2", "2x2"])
def test_a_plugin_that_checkpoints_its_units_itself_passes_with_every_contract(fsdp_check, world, mesh):
    """Dropout on: the wrapper preserves the generator's state, so the recomputation replays the
    forward's masks and the gradients are the reference's."""
    case = _case(world, WRAPPED, mesh_shape=mesh, **{"model.dropout": 0.1})
    verdict = fsdp_check(case)
    assert verdict.ok, verdict.summary()
    checked = {f.comparator for f in verdict.findings if f.kind == "check"}
    assert {"OwnershipCheck", "CommContract"} <= checked, checked


def test_its_twin_that_recomputes_with_new_masks_is_caught(fsdp_check):
    verdict = fsdp_check(_case(2, WITHOUT_RNG_STATE, **{"model.dropout": 0.1}))
    assert not verdict.ok
    assert {f.phase for f in verdict.failures} & {"rng", "grads"}, verdict.summary()


def test_the_contracts_read_the_checkpointing_the_engine_built():
    """A nested unit checkpointed by the engine (fuzz seed 5001's shrunk case: `layers.0.linear`
    inside `layers.0`, both wrapped, world size 1): its forward runs again in the outer unit's
    backward, which the memory model describes only under checkpointing."""
    case = Case(model=ModelSpec(kind="mlp", widths=(1, 1, 1)), world_size=1, steps=1, engine=WRAPPED).with_(
        wrap=("layers.0.linear", "layers.0", "")
    )
    got = Trace("sharded")
    assert as_run(case, got) is case and case_contracts(case, got).memory
    got.meta[ENGINE_CHECKPOINTED] = ["layers.0", "layers.0.linear"]
    assert as_run(case, got).activation_checkpointing and not case.activation_checkpointing
    assert not case_contracts(case, got).memory and case_contracts(case, got).comm
