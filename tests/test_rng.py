"""Randomness: per-rank generator fingerprints against the reference's replay, dropout cases bit
for bit, meta-device init equal to eager init, and reruns identical to the bit."""

import pytest
import torch

from fsdp_verify.case import Case
from fsdp_verify.checks.rng import check_rng
from fsdp_verify.properties import PROPERTIES
from fsdp_verify.properties.rerun import rerun_is_bitwise_identical
from fsdp_verify.reference import train_reference
from fsdp_verify.sharded.pool import get_pool
from fsdp_verify.trace import Trace
from tests.conftest import lm_case, mlp_case

ENGINES = "tests/engines/shared_state.py"


def with_dropout(case: Case, p: float = 0.1) -> Case:
    return case.with_(**{"model.dropout": p})


@pytest.mark.parametrize("case", [with_dropout(mlp_case(2)), with_dropout(lm_case(2))], ids=["mlp", "lm"])
def test_dropout_case_matches_bit_for_bit_and_ranks_draw_their_own_streams(fsdp_check, case):
    verdict = fsdp_check(case)
    assert verdict.ok, verdict.summary()
    rng = [f for f in verdict.findings if f.comparator == "RngCheck"]
    assert [f.kind for f in rng] == ["check"]  # one pass saying what was checked; no device warning on CPU
    assert f"{3 * case.steps} generator fingerprints" in rng[0].message
    logits = [f for f in verdict.findings if f.phase == "logits"]
    assert logits and all(f.ratio == 0 for f in logits)  # exact: each rank's mask reproduced
    ref = train_reference(case)
    fingerprints = [t for (s, p, n), t in ref.records.items() if p == "rng"]
    assert len(fingerprints) == 3 * case.steps  # before and after each forward, after each backward
    assert all(len(set(t.tolist())) == 2 for t in fingerprints)  # two ranks, two streams


def test_same_dropout_mask_on_every_rank_is_caught_by_the_rng_check(fsdp_check):
    verdict = fsdp_check(with_dropout(mlp_case(2, engine="fsdp_verify.zoo.mutants:same_dropout_mask_on_every_rank")))
    first = verdict.first_divergence
    assert (first.step, first.phase, first.comparator) == (1, "rng", "RngCheck"), verdict.summary()
    assert first.name == "after_forward.0" and "same dropout mask" in first.message
    assert any(f.phase == "logits" and not f.ok for f in verdict.findings)  # and the masks show in the logits


@pytest.mark.parametrize("microbatches", [1, 2])
def test_a_backward_that_draws_is_caught_at_that_backward_even_in_one_step(fsdp_check, microbatches):
    """Activation checkpointing that recomputes dropout without restoring the generator: the
    gradients belong to masks no forward drew (a deviation whose size depends on the masks: 5.9x
    its tolerance at the zoo's weakest), and the generator ends the backward further on. That is
    exact: named at step 1's first backward, where a one-step case has no later forward to show it.
    Checkpointing that restores the generator (the loop's own, with dropout) passes."""
    case = with_dropout(lm_case(2, steps=1, microbatches=microbatches), 0.5)
    verdict = fsdp_check(case.with_(engine="fsdp_verify.zoo.mutants:checkpoint_without_rng_state"))
    first = verdict.first_divergence
    assert (first.step, first.phase, first.name, first.comparator) == (1, "rng", "after_backward.0", "RngCheck")
    assert "after backward of micro-batch 0" in first.message, first.message
    correct = fsdp_check(case.with_(activation_checkpointing=True))
    assert correct.ok, correct.summary()
    assert (
        f"{3 * microbatches} generator fingerprints"
        in next(f for f in correct.findings if f.comparator == "RngCheck").message
    )


def test_an_engine_on_another_device_type_gets_a_warning_not_a_failure():
    case = mlp_case(2)
    ref = Trace("reference")
    (warning,) = check_rng(case, ref, Trace("sharded", meta={"param_device_types": ["cuda"]}))
    assert warning.ok and warning.kind == "warning" and "CPU and CUDA generators differ" in warning.message
    assert check_rng(case, ref, Trace("sharded", meta={"param_device_types": ["cpu"]})) == []


def test_meta_init_equals_eager_init_param_by_param():
    case = lm_case(2, init="meta").with_(**{"model.tie_embeddings": True})
    got = get_pool(2).run(case)
    eager = train_reference(case.with_(init="eager"))
    init = {k: t for k, t in eager.records.items() if k[1] in ("init", "buffers") and k[0] == 0}
    assert len(init) > 10
    for key, want in init.items():
        assert torch.equal(got.records[key], want), key


def test_meta_build_that_consumes_rng_is_caught_at_init(fsdp_check):
    verdict = fsdp_check(lm_case(2, engine="fsdp_verify.zoo.mutants:meta_init_consumes_rng", init="meta"))
    first = verdict.first_divergence
    assert (first.step, first.phase, first.comparator) == (0, "init", "InitParamsComparator"), verdict.summary()


def test_rerun_of_the_correct_engine_is_bitwise_identical():
    case = with_dropout(lm_case(2))
    assert rerun_is_bitwise_identical(case) == []
    verdict = PROPERTIES["rerun-is-bitwise-identical"](case)
    assert verdict.ok and len(verdict.findings) > 100


def test_state_leaking_between_runs_is_named_at_the_first_record_that_differs():
    findings = rerun_is_bitwise_identical(mlp_case(2, engine=f"{ENGINES}:leaks_state_between_runs"))
    first = findings[0]
    assert (first.step, first.phase, first.name) == (0, "init", "layers.0.linear.bias")
    assert first.comparator == "RerunDeterminism" and "max abs difference" in first.message
