"""FSDP2 on a (replicate, shard) mesh, which it always runs as HSDP: the reference emulates its
reduction (reference/trainer.py: `_hsdp_average`, a reduce-scatter over each shard group in
gloo's order, divided by S, then an all-reduce over the replicas in gloo's order, divided by R),
so the correct engine is bit-exact on CPU/gloo, in fp32 and in a bf16 reduction alike."""

import pytest

from fsdp_verify.case_specs import LossScaleSpec, OptimSpec, PrecisionSpec
from tests.conftest import lm_case, mlp_case, regression

BF16 = PrecisionSpec(param_dtype="bf16", reduce_dtype="bf16")
FP16 = PrecisionSpec(param_dtype="fp16", reduce_dtype="fp16")


def _inexact(verdict) -> list:
    return [(f.key, f.max_abs) for f in verdict.findings if f.phase != "param_sums" and f.max_abs != 0]


# Emulated as one reduction over the whole world instead, the (2, 2) fp32 MLP was 0.28x its
# tolerance (not equal); (3, 1) and (1, 3) need gloo's segments of each unit's whole buffer (the
# per-parameter ring order of the 1-D emulation is 0.099x off at 3 ranks, `_average`).
EXACT = {
    "hsdp-2x2-clip-adam": mlp_case(4, mesh_shape=(2, 2), clip_norm=0.01, microbatches=2, optim=OptimSpec(name="adam")),
    "hsdp-2x2-sync-last": lm_case(4, mesh_shape=(2, 2), microbatches=2, sync_every_microbatch=False),
    "all-reduce-only-3x1-bf16": lm_case(3, mesh_shape=(3, 1), clip_norm=0.01, precision=BF16),
    "reduce-scatter-only-1x3": mlp_case(3, mesh_shape=(1, 3), clip_norm=0.01, microbatches=2),
    # The sum over 3 ranks divided by 3, then the sum over 2 replicas by 2 (not the sum of 6 by 6).
    "hsdp-2x3-adam": mlp_case(6, mesh_shape=(2, 3), clip_norm=0.01, microbatches=2, optim=OptimSpec(name="adam")),
    # fp16: pre-divided by 2, summed over both groups, post-divided by 2.
    "hsdp-2x2-fp16-loss-scaled": mlp_case(4, mesh_shape=(2, 2), precision=FP16, loss_scaling=LossScaleSpec()),
}


@pytest.mark.parametrize("name", list(EXACT))
def test_fsdp2_hsdp_is_bit_exact(fsdp_check, name):
    verdict = fsdp_check(EXACT[name], calibrate=False)
    assert verdict.ok, verdict.summary()
    assert not _inexact(verdict)


@pytest.mark.parametrize("key", ["9cb25bcb5c15", "3a342221e58f"])
def test_fsdp2_hsdp_bf16_reduction_false_alarms(fsdp_check, key):
    """Fuzz false alarms (tests/regressions/README.md), (2, 2) with a bf16 reduction, both failing
    while the reference summed the 4 ranks in one ring and divided by 4 once: a gradient that is
    zero in exact arithmetic (one token, one head: `wk`'s) came out as rounding noise in FSDP2's
    grouping and exactly 0 in the reference's, and the all-zero record's tolerance is 0; and
    AdamW turned one bf16 gradient element rounded the other way into a whole lr step (625x).
    Bit-exact now, uncalibrated."""
    verdict = fsdp_check(regression(key), calibrate=False)
    assert verdict.ok, verdict.summary()
    assert not _inexact(verdict)


def test_fsdp2_hsdp_reduced_over_the_whole_world_is_not_bit_exact(fsdp_check):
    """The bit-exact check has teeth: FSDP2 on the flattened mesh (`shards_over_the_replicas`)
    computes the same average over the same ranks in another grouping, inside the tolerance but
    not equal."""
    case = EXACT["hsdp-2x2-clip-adam"].with_(engine="tests/engines/comm_faults.py:shards_over_the_replicas")
    verdict = fsdp_check(case, calibrate=False)
    assert _inexact(verdict)


@pytest.mark.parametrize("mutant", ["replicas_not_reduced", "divides_by_shard_group"])
def test_fsdp2_hsdp_reduction_bugs_are_caught(fsdp_check, mutant):
    case = mlp_case(4, mesh_shape=(2, 2), steps=1).with_(engine=f"tests/engines/hsdp_faults.py:{mutant}")
    verdict = fsdp_check(case)
    assert not verdict.ok
    assert any(not f.ok and f.phase == "grads" for f in verdict.findings), verdict.summary()
