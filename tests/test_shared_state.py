"""Shared state: buffers equal on every rank and to the reference, frozen parameters unmoved."""

import torch

from fsdp_verify.reference import train_reference
from fsdp_verify.sharded.pool import get_pool
from tests.conftest import lm_case, mlp_case

ENGINES = "tests/engines/shared_state.py"
FROZEN = ("layers.0.attention_norm", "tok_embeddings")


def test_buffers_and_frozen_params_hold_on_the_correct_engine(fsdp_check):
    case = lm_case(2).with_(**{"model.frozen": FROZEN, "model.dropout": 0.1})
    verdict = fsdp_check(case)
    assert verdict.ok, verdict.summary()
    buffers = [f for f in verdict.findings if f.phase == "buffers" and f.kind == "deviation"]
    assert [(f.step, f.name) for f in buffers] == [(s, "freqs") for s in range(case.steps + 1)]
    assert all(f.comparator == "BuffersComparator" and f.ratio == 0 for f in buffers)
    got = get_pool(2).run(case)
    for step, per_buffer in got.meta["buffer_hashes"].items():
        assert len(set(per_buffer["freqs"])) == 1, step
    frozen = "layers.0.attention_norm.weight"
    assert torch.equal(got.records[(case.steps, "params", frozen)], got.records[(0, "init", frozen)])
    assert (1, "grads", frozen) not in got.records


def test_buffer_left_uninitialised_off_rank0_is_caught_across_ranks(fsdp_check):
    verdict = fsdp_check(lm_case(2, engine="fsdp_verify.zoo.mutants:buffer_uninitialised_off_rank0"))
    first = verdict.first_divergence
    assert (first.step, first.phase, first.name, first.comparator) == (0, "buffers", "freqs", "BufferRanksCheck")
    assert "rank(s) [1]" in first.message


def test_buffer_that_differs_from_the_reference_on_every_rank_is_caught(fsdp_check):
    verdict = fsdp_check(lm_case(2, engine=f"{ENGINES}:buffers_reinitialised_with_other_defaults"))
    first = verdict.first_divergence
    assert (first.step, first.phase, first.name, first.comparator) == (0, "buffers", "freqs", "BuffersComparator")
    assert not any(f.comparator == "BufferRanksCheck" for f in verdict.failures)  # the ranks agree


def test_frozen_params_that_move_are_caught(fsdp_check):
    case = mlp_case(2, engine="fsdp_verify.zoo.mutants:frozen_params_move").with_(**{"model.frozen": ("layers.1",)})
    verdict = fsdp_check(case)
    frozen = [f for f in verdict.failures if f.comparator == "FrozenParamsCheck"]
    assert {(f.step, f.phase, f.name) for f in frozen} == {
        (1, phase, f"layers.1.linear.{p}") for phase in ("grads", "params") for p in ("weight", "bias")
    }
    assert verdict.first_divergence.step == 1 and verdict.first_divergence.phase == "grads"


def test_reference_records_buffers_at_every_step():
    case = lm_case(2, steps=2)
    ref = train_reference(case)
    assert sorted(k for k in ref.records if k[1] == "buffers") == [(s, "buffers", "freqs") for s in range(3)]
