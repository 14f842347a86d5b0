"""Gradient clipping must use the GLOBAL norm: the local squared norms all-reduced (seed 001's
worked example: local norms 2.236, 5, 7.81, 10.63 make a global 14.283, not 10.63)."""

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fsdp_verify.properties.strategies import CLIP_NORMS, cases
from fsdp_verify.reference import train_reference
from tests.conftest import mlp_case

# Four ranks' shards of one gradient, with seed 001's local norms sqrt(5), 5, sqrt(61), sqrt(113).
SHARDS = [torch.tensor(v, dtype=torch.float64) for v in ([1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0])]


def test_seed_001_global_norm_is_the_root_of_the_all_reduced_local_squares():
    local = [s.norm() for s in SHARDS]
    assert [round(n.item(), 2) for n in local] == [2.24, 5.0, 7.81, 10.63]
    # Each rank sends its local *squared* norm (sum of squares, exact for these integers; squaring
    # the rounded root would not be), the all-reduce sums them, the root is taken once.
    squares = torch.stack([(s * s).sum() for s in SHARDS])
    global_norm = squares.sum().sqrt()
    assert round(global_norm.item(), 3) == 14.283
    assert squares.sum().item() == 204.0  # 5 + 25 + 61 + 113, exactly
    # The root of exactly 204 (torch's scalar sqrt may differ from math.sqrt in the last bit).
    assert global_norm.item() == pytest.approx(math.sqrt(204), rel=2**-52)
    assert torch.isclose(global_norm, torch.nn.utils.get_total_norm(SHARDS))
    assert torch.isclose(global_norm, torch.cat(SHARDS).norm())
    assert max(n.item() for n in local) < global_norm.item() - 3  # the local norm is a different number


def test_clipping_by_the_global_norm_scales_every_shard_alike():
    full = torch.cat(SHARDS).clone()
    params = [torch.zeros_like(s, requires_grad=True) for s in SHARDS]
    for p, s in zip(params, SHARDS):
        p.grad = s.clone()
    total = torch.nn.utils.clip_grad_norm_(params, max_norm=1.0)
    clipped = [p.grad for p in params]
    assert total.item() == math.sqrt(204)
    assert torch.allclose(torch.cat(clipped), full / (math.sqrt(204) + 1e-6))
    assert torch.isclose(torch.cat(clipped).norm(), torch.tensor(1.0, dtype=torch.float64), atol=1e-5)
    local_clip = SHARDS[3] / SHARDS[3].norm()  # what rank 3 does with its local norm
    assert not torch.allclose(local_clip, clipped[3])


def test_correct_fsdp2_returns_the_reference_global_norm_on_four_ranks(fsdp_check):
    verdict = fsdp_check(mlp_case(4, clip_norm=1e-3))
    norms = [f for f in verdict.findings if f.phase == "grad_norm"]
    assert len(norms) == 2 and all(f.ok for f in norms), verdict.summary()
    assert verdict.ok, verdict.summary()


def test_clipping_with_the_local_norm_is_caught_by_the_grad_norm_comparator(fsdp_check):
    verdict = fsdp_check(mlp_case(4, clip_norm=1e-3, engine="fsdp_verify.zoo.mutants:clip_with_local_norm"))
    first = verdict.first_divergence
    assert (first.step, first.phase, first.comparator) == (1, "grad_norm", "GradNormComparator"), verdict.summary()
    assert first.ratio > 100


def _really_clips(case) -> None:
    trace = train_reference(case)
    norms = [trace.records[(step, "grad_norm", "total_norm")].item() for step in range(1, case.steps + 1)]
    assert all(n > case.clip_norm for n in norms), (norms, case.clip_norm, case.to_json())


# A clip_norm above the total norm tests nothing: every generated step must exceed it. CI draws
# 15 cases (the README's test command has a 12-minute budget), the nightly 40.
@settings(max_examples=15, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck))
@given(cases(clip_norm=st.sampled_from(CLIP_NORMS)))
def test_generated_clipping_cases_really_clip(case):
    _really_clips(case)


@pytest.mark.slow
@settings(max_examples=40, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck))
@given(cases(clip_norm=st.sampled_from(CLIP_NORMS)))
def test_generated_clipping_cases_really_clip_nightly(case):
    _really_clips(case)
