"""The correct FSDP2 engine agrees with the reference: real gloo process groups, real FSDP2."""

import pytest

from fsdp_verify.case import Case
from fsdp_verify.case_specs import DataSpec, PrecisionSpec
from tests.conftest import TINY_LM, lm_case, mlp_case

BF16 = PrecisionSpec(param_dtype="bf16", reduce_dtype="fp32")


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("precision", [PrecisionSpec(), BF16], ids=["fp32", "bf16"])
def test_fsdp2_mlp_uneven_shards(fsdp_check, world_size, precision):
    verdict = fsdp_check(mlp_case(world_size, precision=precision))
    assert verdict.ok, verdict.summary()


@pytest.mark.parametrize("world_size", [2, 3])
def test_fsdp2_transformer_bf16_with_clipping_and_microbatches(fsdp_check, world_size):
    case = lm_case(world_size, precision=BF16, clip_norm=0.05, microbatches=2, data=DataSpec(batch_size=4 * world_size))
    verdict = fsdp_check(case)
    assert verdict.ok, verdict.summary()
    assert any(f.phase == "grad_norm" for f in verdict.findings)


def test_fsdp2_sync_only_on_last_microbatch_bf16(fsdp_check):
    case = mlp_case(2, precision=BF16, microbatches=2, sync_every_microbatch=False)
    verdict = fsdp_check(case)
    assert verdict.ok, verdict.summary()


def test_fsdp2_world_size_2_fp32_is_bit_exact(fsdp_check):
    """With two ranks the reduction order is fixed (a + b == b + a), so the emulating reference
    must agree to the bit on every record but the float64 parameter sums."""
    verdict = fsdp_check(mlp_case(2, optim=Case().optim.__class__(name="adam")), calibrate=False)
    assert verdict.ok, verdict.summary()
    inexact = [f for f in verdict.findings if f.phase != "param_sums" and f.max_abs != 0]
    assert not inexact, [(f.key, f.max_abs) for f in inexact]


def test_default_case_is_the_transformer_at_world_size_2():
    case = Case()
    assert case.model == Case().model and case.model.kind == "transformer" and case.world_size == 2
    assert TINY_LM.kind == "transformer"


def test_unit_inside_a_block_without_input_casting(fsdp_check):
    """Regression (found by the zoo sweep): a unit around `layers.0.linear` only, inputs not cast.
    The block outside the unit saw the fp32 shard's dtype and fed fp32 into a bf16 matmul."""
    case = mlp_case(
        2,
        wrap=("layers.0.linear", ""),
        precision=PrecisionSpec(param_dtype="bf16", reduce_dtype="fp32", cast_forward_inputs=False),
    )
    verdict = fsdp_check(case)
    assert verdict.ok, verdict.summary()
