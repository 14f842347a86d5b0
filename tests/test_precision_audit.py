"""Precision contract: what FSDP2 does (dtypes seen at run time) must match the declared policy,
even where the numbers happen to agree."""

import pytest

from fsdp_verify.case_specs import PrecisionSpec
from fsdp_verify.checks.precision import check_precision, expected_dtypes
from fsdp_verify.trace import Trace
from tests.conftest import lm_case, mlp_case

FP32 = PrecisionSpec()
BF16 = PrecisionSpec(param_dtype="bf16", reduce_dtype="fp32")
BF16_OUT_FP32 = PrecisionSpec(param_dtype="bf16", reduce_dtype="fp32", output_dtype="fp32")
BF16_ALL = PrecisionSpec(param_dtype="bf16", reduce_dtype="bf16", output_dtype="bf16")


def _contract(verdict):
    return [f for f in verdict.findings if f.comparator == "PrecisionContract" and f.kind != "check"]


@pytest.mark.parametrize(
    "precision", [FP32, BF16, BF16_OUT_FP32, BF16_ALL], ids=["fp32", "bf16", "bf16-out-fp32", "bf16-reduce-bf16"]
)
def test_correct_fsdp2_keeps_the_contract_and_the_probe_saw_every_stage(fsdp_check, precision):
    case = mlp_case(2, precision=precision, microbatches=2, clip_norm=0.01)
    verdict = fsdp_check(case)
    assert not _contract(verdict), [f.message for f in _contract(verdict)]
    assert verdict.ok, verdict.summary()


def test_transformer_bf16_with_output_dtype_and_sync_on_the_last_microbatch(fsdp_check):
    case = lm_case(2, precision=BF16_OUT_FP32, microbatches=2, sync_every_microbatch=False)
    verdict = fsdp_check(case)
    assert verdict.ok, verdict.summary()


def test_no_sync_accumulation_is_in_reduce_dtype_as_fsdp2_does_it(fsdp_check):
    """FSDP2 upcasts a no-sync bf16 gradient to reduce_dtype and accumulates later micro-batches
    there (FSDPParam.to_accumulated_grad_if_needed); the reference models it, so at world size 2
    the run agrees bit for bit without any calibration (accumulating in bf16 would not)."""
    case = mlp_case(2, precision=BF16, microbatches=3, sync_every_microbatch=False, steps=1)
    verdict = fsdp_check(case, calibrate=False)
    assert verdict.ok, verdict.summary()
    inexact = [f.key for f in verdict.findings if f.phase in ("grads", "params") and f.max_abs != 0]
    assert not inexact, inexact


def test_wrapped_norm_regroups_bf16_gradient_sums_as_the_reference_models_it(fsdp_check):
    """A wrapped RMSNorm puts FSDP2's post-backward autograd node on the residual stream, which
    changes the order of the bf16 gradient sum into the embedding (found by the sweep: one bf16
    ulp, 1e3x the bound). The reference inserts the same node, so the run is bit-exact."""
    case = lm_case(1, precision=BF16, wrap=("layers.0.attention_norm", ""), steps=1)
    verdict = fsdp_check(case, calibrate=False)
    assert verdict.ok, verdict.summary()
    assert all(f.max_abs == 0 for f in verdict.findings if f.phase == "grads")


def test_probe_records_each_stage_in_the_dtype_the_policy_names():
    """The probe's record itself (not just the absence of findings): every stage is observed."""
    from fsdp_verify.sharded.pool import get_pool

    case = mlp_case(2, precision=BF16_OUT_FP32, steps=1)
    seen = get_pool(2).run(case).meta["precision"]["steps"]
    stages = {**seen["0"], **seen["1"]}
    expected = expected_dtypes(case)
    assert set(expected) <= set(stages), sorted(set(expected) - set(stages))
    for stage, names in stages.items():
        assert names, stage
        assert all(dtypes == [expected[stage]] for dtypes in names.values()), (stage, names)
    assert set(stages["forward_params"]) == {n for n in stages["sharded"]}


@pytest.mark.parametrize(
    ("engine", "precision", "stage", "seen"),
    [
        ("fsdp_verify.zoo.mutants:param_dtype_ignored", BF16, "backward_grads", "fp32"),
        ("fsdp_verify.zoo.mutants:param_dtype_ignored", BF16, "forward_params", "fp32"),
        ("fsdp_verify.zoo.mutants:reduce_in_bf16", BF16, "reduce", "bf16"),
        ("tests/engines/precision_faults.py:output_dtype_ignored", BF16_OUT_FP32, "outputs", "bf16"),
        ("fsdp_verify.zoo.mutants:master_weights_in_bf16", FP32, "sharded", "bf16"),
        ("fsdp_verify.zoo.mutants:master_weights_in_bf16", FP32, "optim_state", "bf16"),
        ("fsdp_verify.zoo.mutants:master_weights_in_bf16", FP32, "grads", "bf16"),
    ],
)
def test_contract_breach_is_a_finding(fsdp_check, engine, precision, stage, seen):
    verdict = fsdp_check(mlp_case(2, engine=engine, precision=precision))
    by_stage = {f.name.split(":", 1)[0]: f for f in _contract(verdict)}
    assert stage in by_stage, [f.message for f in _contract(verdict)]
    finding = by_stage[stage]
    assert (finding.phase, finding.kind, finding.ok) == ("precision", "contract", False)
    assert f"in {seen}" in finding.message
    assert not verdict.ok


def test_reduce_in_bf16_is_caught_by_the_contract_before_any_number(fsdp_check):
    """bf16 reduction at world size 2 moves the gradients by about one bf16 rounding, which a
    calibrated tolerance can absorb; the contract names it at step 1 before logits are compared."""
    verdict = fsdp_check(mlp_case(2, engine="fsdp_verify.zoo.mutants:reduce_in_bf16", precision=BF16))
    first = verdict.first_divergence
    assert (first.step, first.phase, first.comparator) == (1, "precision", "PrecisionContract"), verdict.summary()
    assert "gradients reduced" in first.message and "the policy says fp32" in first.message


# ---- the check's logic on hand-written records (no processes) ------------------------------------
def _trace(steps: dict) -> Trace:
    return Trace("sharded", meta={"precision": {"steps": steps}})


def test_expected_dtypes_follow_fsdp2_defaults():
    assert expected_dtypes(mlp_case(2))["reduce"] == "fp32"
    bf16_no_reduce = expected_dtypes(mlp_case(2, precision=PrecisionSpec(param_dtype="bf16")))
    assert bf16_no_reduce["reduce"] == "bf16"  # reduce_dtype unset: reduce in param_dtype
    assert bf16_no_reduce["grads"] == "fp32"  # cast back to the shard's dtype
    assert "outputs" not in bf16_no_reduce
    no_cast = PrecisionSpec(param_dtype="bf16", cast_forward_inputs=False)
    assert "forward_inputs" not in expected_dtypes(mlp_case(2, precision=no_cast))


def test_first_step_of_each_mismatch_is_reported_once():
    case = mlp_case(2, precision=BF16)
    steps = {
        "0": {"sharded": {"a": ["fp32"]}},
        "1": {"forward_params": {"a": ["bf16"]}, "reduce": {"reduce_scatter": ["fp32"]}},
        "2": {"forward_params": {"a": ["bf16", "fp32"]}, "reduce": {"reduce_scatter": ["bf16"]}},
        "3": {"forward_params": {"a": ["fp32"]}},
    }
    findings = check_precision(case, Trace("reference"), _trace(steps))
    assert sorted((f.step, f.name) for f in findings) == [(2, "forward_params:a"), (2, "reduce:reduce_scatter")]
    assert all(f.comparator == "PrecisionContract" and not f.ok for f in findings)


def test_correct_record_gives_no_finding_and_a_missing_record_is_one():
    case = mlp_case(2, precision=BF16)
    ok = {"1": {"forward_params": {"a": ["bf16"]}, "grads": {"a": ["fp32"]}}}
    assert check_precision(case, Trace("reference"), _trace(ok)) == []
    missing = check_precision(case, Trace("reference"), Trace("sharded"))
    assert [(f.kind, f.ok) for f in missing] == [("missing", False)]


def test_master_weights_in_bf16_are_named_by_dtype_before_any_value(fsdp_check):
    """Seed 000: the sharded master weights must stay fp32. A model cast to bf16 before sharding
    rounds every initial value; the first divergence names the dtype (a precision finding at step
    0), not "ranks initialised differently", and the hint says what to change."""
    verdict = fsdp_check(mlp_case(2, engine="fsdp_verify.zoo.mutants:master_weights_in_bf16", steps=1))
    first = verdict.first_divergence
    assert (first.step, first.phase, first.name.split(":")[0]) == (0, "precision", "sharded"), verdict.summary()
    assert "sharded parameter" in first.message and "in bf16, the policy says fp32" in first.message
    assert "master weights" in verdict.hint and "held in bf16" in verdict.hint
    assert "model.to(bf16)" in verdict.hint
    init = [f for f in verdict.failures if f.phase == "init"]
    assert init, "the rounded initial values still diverge too"
