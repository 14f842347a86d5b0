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
