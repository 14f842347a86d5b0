"""Every comparator must be able to fail: broken engines, each caught at the right place."""

import pytest

from tests.conftest import mlp_case


@pytest.mark.parametrize(
    ("engine", "phase", "hint"),
    [
        ("fsdp_verify.zoo.mutants:grads_divided_twice", "grads", "divided by the world size once too often"),
        ("fsdp_verify.zoo.mutants:grad_sync_off_for_one_unit", "grads", ""),
        ("fsdp_verify.zoo.mutants:rank1_different_init", "init", "initialised differently"),
        ("fsdp_verify.zoo.mutants:inputs_cast_to_bf16", "logits", ""),
    ],
)
def test_mutant_is_caught_at_the_right_first_divergence(fsdp_check, engine, phase, hint):
    verdict = fsdp_check(mlp_case(2, engine=engine))
    assert not verdict.ok
    first = verdict.first_divergence
    assert (first.step, first.phase) == ((0 if phase == "init" else 1), phase), verdict.summary()
    assert hint in verdict.hint
    assert "DIVERGED" in verdict.summary()


def test_one_rank_with_a_tiny_activation_error_is_caught_in_fp32(fsdp_check):
    """A 1e-5 relative error on one rank's activations must not hide under the tolerance."""
    verdict = fsdp_check(mlp_case(2, engine="tests/engines/faulty.py:rank1_activation_error"))
    assert not verdict.ok
    first = verdict.first_divergence
    assert (first.step, first.phase) == (1, "logits"), verdict.summary()
    assert first.ratio > 2, first.ratio
    assert "only the samples of rank(s) [1]" in verdict.hint


# The step hints on real engines: each where it fits and where it must not fire.
FAULTY = "tests/engines/faulty.py:"
ZOO = "fsdp_verify.zoo.mutants:"


@pytest.mark.parametrize(
    ("engine", "world_size", "says", "never"),
    [
        # every gradient W x or 1/W x: the division named
        (ZOO + "grads_not_averaged", 3, "world_size x the reference's (the world size: 3): divided by", "cannot tell"),
        (ZOO + "grads_divided_twice", 4, "1/world_size x the reference's (the world size: 4)", "only rank"),
        # 2x at three ranks is no world size; at two it is, and twice: said to be ambiguous
        (ZOO + "offload_grad_added_twice", 3, "every gradient of the step is 2x the reference's", "world size"),
        (ZOO + "offload_grad_added_twice", 2, "cannot tell", "too rarely"),
        # one unit divided twice: the gradients that are 1/W named, no whole-step division claimed
        (FAULTY + "one_unit_divided_twice", 2, "2 of the step's 6 gradients are", "once too often"),
        # one rank's reduced shard changed: that rank named; one rank's gradient before the
        # reduction reaches every rank's shard: no rank named
        (FAULTY + "rank1_reduced_grad_scaled", 2, "only rank(s) [1]'s shards of the reduced gradient", "world_size"),
        (ZOO + "rank1_grad_off_by_2e6_once", 2, "", "only rank"),
        # logits: one rank's samples, or every rank's
        (FAULTY + "rank1_activation_error", 2, "only the samples of rank(s) [1] differ", "world_size"),
        (ZOO + "inputs_cast_to_bf16", 2, "", "only the samples"),
    ],
)
def test_each_step_hint_fits_its_mutant_and_not_another(fsdp_check, engine, world_size, says, never):
    case = mlp_case(world_size, engine=engine, steps=1)
    if "offload" in engine:
        case = case.with_(offload=True)
    verdict = fsdp_check(case)
    assert not verdict.ok and verdict.first_divergence.step == 1, verdict.table()
    assert says in verdict.hint and never not in verdict.hint, verdict.hint


@pytest.mark.parametrize("seed", [0, 2])
def test_a_2e6_error_in_one_ranks_gradient_in_one_step_is_caught_in_fp32(fsdp_check, seed):
    """The smallest promise: fp32, world size 2, rank 1's local gradients 1 + 2e-6 times too large
    in step 1 only (logits and loss untouched). Neither the MARGIN-triggered calibration nor the
    derived floor may absorb it: at world size 2 no summation order is free, so the floor is 0."""
    case = mlp_case(2, engine="fsdp_verify.zoo.mutants:rank1_grad_off_by_2e6_once", steps=1, seed=seed, data_seed=seed)
    verdict = fsdp_check(case)
    first = verdict.first_divergence
    assert not verdict.ok and (first.step, first.phase) == (1, "grads"), verdict.summary()
    assert first.ratio > 1.1, first.ratio
