"""Activation checkpointing on a model whose forward writes state: a `transformers` GPT-2 built
from its config's defaults (`use_cache=True`) appends its keys to the KV cache again when a
checkpointed block is recomputed in backward (`The size of tensor a (8) must match the size of
tensor b (4)`, every rank, every engine). The toolkit turns the cache off on the reference and on
every rank, as `transformers`' own `gradient_checkpointing_enable()` does, and says so in the
verdict (verify/training/checkpointing.py). Running statistics have no such switch: a checkpointed
unit holding a BatchNorm is refused as bad input (verify/case_rules.py)."""

from __future__ import annotations

import pytest
import torch

from fsdp_verify.case import Case, CaseError
from fsdp_verify.case_specs import DataSpec
from fsdp_verify.commands.cli import main
from fsdp_verify.engines.arithmetic import FSDP2
from fsdp_verify.models import ModelSpec, build_model
from fsdp_verify.reference.reference_model import reference_model
from fsdp_verify.runner import check_case
from fsdp_verify.sharded.pool import get_pool
from fsdp_verify.training.checkpointing import checkpoint_units, without_kv_cache
from tests.conftest import require

GPT2 = ModelSpec(kind="custom", factory="tests/user/gpt2.py:tiny_gpt2", seq_len=6)


def gpt2_case(engine: str = "fsdp2", checkpointing: bool = True, world_size: int = 2) -> Case:
    """What the pytest strategy shrank the crash to: Dropout modules and the blocks their own
    units, padded batches (an attention mask, so the doubled keys meet it)."""
    require("transformers")
    return Case(
        model=GPT2,
        wrap=("Dropout", "GPT2Block", ""),
        world_size=world_size,
        steps=1,
        data=DataSpec(batch_size=2 * world_size, padded=True),
        activation_checkpointing=checkpointing,
        engine=engine,
    )


def _grads(model: torch.nn.Module, tokens: torch.Tensor, mask: torch.Tensor | None) -> dict[str, torch.Tensor]:
    torch.manual_seed(7)  # the dropout masks (default p=0.1), replayed by the recomputation
    model(tokens, attention_mask=mask).logits.square().sum().backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize(
    ("length", "padded", "error"),
    [
        # Padded: the recomputed attention's 12 keys meet the 6-wide mask (FSDP2's and FSDP1's crash).
        (6, True, r"The size of tensor a \(12\) must match the size of tensor b \(6\)"),
        # One token, no mask (SDPA attends without one and without trimming the keys): the saved
        # keys come back twice as long, which checkpoint's own check names (the flat engine's
        # CheckpointError, at world size 1 as well: no engine takes part).
        (1, False, "Recomputed values for the following tensors have different metadata"),
    ],
)
def test_a_recomputed_gpt2_block_appends_to_the_cache_and_without_it_gives_the_same_gradients(length, padded, error):
    """In one process, no engine: the failure itself, then the fix's gradients bit for bit those
    of the forward without checkpointing. (Unpadded, longer than a token, SDPA trims the doubled
    keys back to the forward's: the same gradients, the cache silently written twice.)"""
    require("transformers")
    tokens = torch.randint(0, 97, (2, length), generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[1] * length, [1] * (length - 2) + [0] * 2]) if padded else None
    plan = ("transformer.h.0", "transformer.h.1", "")
    plain = _grads(build_model(GPT2, seed=3), tokens, mask)
    cached = build_model(GPT2, seed=3)
    checkpoint_units(cached, plan)
    with pytest.raises(RuntimeError, match=error):  # CheckpointError is a RuntimeError
        _grads(cached, tokens, mask)
    model = build_model(GPT2, seed=3)
    assert model.config.use_cache is True  # the config's default, as a user's factory keeps it
    assert without_kv_cache(model) == [""]  # one config object, shared by every submodule
    assert model.config.use_cache is False and without_kv_cache(model) == []
    checkpoint_units(model, plan)
    got = _grads(model, tokens, mask)
    assert all(torch.equal(got[n], g) for n, g in plain.items())


def test_the_reference_runs_without_the_cache_exactly_when_the_ranks_do():
    model = reference_model(gpt2_case(checkpointing=True), FSDP2)
    assert model.config.use_cache is False
    assert reference_model(gpt2_case(checkpointing=False), FSDP2).config.use_cache is True


@pytest.mark.parametrize("engine", ["fsdp2", "fsdp1", "flat"])
def test_a_checkpointed_gpt2_with_its_default_cache_passes_and_the_verdict_says_the_cache_was_off(engine):
    # Without the fix every rank crashed in step 1's backward (exit 3) under each engine.
    verdict = check_case(gpt2_case(engine), pool=get_pool(2), timeout_s=240)
    assert verdict.ok, verdict.summary()
    assert "Note: activation checkpointing: model.config had use_cache=True; turned off" in verdict.summary()
    notes = [f for f in verdict.findings if f.kind == "note"]
    assert [(f.phase, f.comparator, f.ok) for f in notes] == [("build", "ActivationCheckpointing", True)]


def test_without_checkpointing_the_cache_stays_and_no_note_is_given():
    verdict = check_case(gpt2_case(checkpointing=False), pool=get_pool(2), timeout_s=240)
    assert verdict.ok, verdict.summary()
    assert "Note:" not in verdict.summary() and not [f for f in verdict.findings if f.kind == "note"]


# ---- state with no switch: running statistics -----------------------------------------------------
BATCHNORM = ModelSpec(kind="custom", factory="tests/user/models.py:batchnorm_lm", seq_len=6)


def test_a_checkpointed_unit_holding_batchnorm_is_refused_as_bad_input(capsys):
    """BatchNorm's running statistics have no off switch: recomputed, they are updated twice on
    the ranks, once on the reference (measured before the refusal: DIVERGED at step 1's buffers,
    'bn.num_batches_tracked' 2x the reference's, at world size 1, an alarm no engine caused)."""
    with pytest.raises(CaseError, match=r"^activation_checkpointing: expected false, or a wrap plan whose units hold"):
        Case(model=BATCHNORM, wrap=("BatchNorm1d", "UserBlock", ""), activation_checkpointing=True)
    Case(model=BATCHNORM, wrap=("BatchNorm1d", "UserBlock", ""))  # without checkpointing: fine
    Case(model=BATCHNORM, wrap=("UserBlock", ""), activation_checkpointing=True)  # bn in the root: never recomputed
    args = [
        "check",
        "--model",
        BATCHNORM.factory,
        "--world-size",
        "1",
        "--wrap",
        "bn",
        "",
        "--activation-checkpointing",
    ]
    assert main(args) == 2
    assert "unit 'bn' holds ['bn']: its recomputation in backward would update them a second time" in (
        capsys.readouterr().err
    )
