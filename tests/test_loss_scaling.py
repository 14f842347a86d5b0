"""fp16 dynamic loss scaling (seed 002): the scale and each rank's skip decision per step, held to
the reference's emulation exactly; the zoo's two scaling bugs caught where they first show."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fsdp_verify.case import Case, CaseError, ModelSpec
from fsdp_verify.case_specs import DataSpec, LossScaleSpec, OptimSpec, PrecisionSpec
from fsdp_verify.commands.cli import main
from fsdp_verify.commands.selftest import hunt
from fsdp_verify.compare.comparators import compare_traces
from fsdp_verify.engines.arithmetic import Arithmetic
from fsdp_verify.properties.pins import PinError
from fsdp_verify.properties.strategies import cases
from fsdp_verify.reference import train_reference
from fsdp_verify.trace import Trace
from fsdp_verify.zoo.catalog import BY_NAME
from tests.conftest import mlp_case, regression

FP16 = PrecisionSpec(param_dtype="fp16", reduce_dtype="fp32")
SHARDED_SCALER = "tests/engines/scalers.py:fsdp2_sharded_grad_scaler"


def scaled_case(world_size: int = 2, init_scale: float = 2.0**16, data_scale: float = 1.0, **changes) -> Case:
    """Growth after every good step: at 2**16 the scale grows twice, then the scaled gradients
    overflow fp16 in step 3, which every rank skips, and the scale backs off (measured on the
    reference: skipped [0, 0, 1, 0], scales 65536, 131072, 262144, 131072)."""
    changes.setdefault("steps", 4)
    return mlp_case(
        world_size,
        precision=FP16,
        data=DataSpec(batch_size=world_size * 2, scale=data_scale),
        loss_scaling=LossScaleSpec(init_scale=init_scale, growth_interval=1),
        **changes,
    )


def decisions(trace: Trace, name: str) -> list[list[float]]:
    return [trace.records[(s, "loss_scale", name)].tolist() for s in range(1, trace.steps + 1)]


# ---- the case and its records -------------------------------------------------------------------
def test_loss_scaling_is_optional_and_round_trips():
    plain = mlp_case(2)
    assert "loss_scaling" not in plain.to_dict()  # older cases keep their JSON and hash
    case = scaled_case()
    again = Case.from_json(case.to_json())
    assert again == case and again.hash == case.hash != plain.hash
    assert again.loss_scaling == LossScaleSpec(init_scale=2.0**16, growth_interval=1)


def test_pinned_regression_cases_keep_their_hashes():
    """Each tests/regressions/NAME.json still loads as the case named NAME (its hash): a Case
    without loss_scaling hashes as before the field existed."""
    files = sorted((Path(__file__).parent / "regressions").glob("*.json"))
    assert files
    for path in files:
        case = Case.load(path)
        assert case.hash == path.stem, path
        assert case.loss_scaling is None or "loss_scaling" in json.loads(path.read_text()), path


@pytest.mark.parametrize(
    ("field", "value"),
    [("init_scale", 0.0), ("growth_factor", 1.0), ("backoff_factor", 1.5), ("growth_interval", 0)],
)
def test_a_bad_loss_scale_names_its_field(field, value):
    with pytest.raises(CaseError, match=f"loss_scaling.{field}"):
        Case.from_dict({"loss_scaling": {field: value}})


def test_a_users_step_cannot_also_be_loss_scaled():
    with pytest.raises(CaseError, match="loss_scaling"):
        Case(step="examples.user_step:train_step", loss_scaling=LossScaleSpec())


def test_the_reference_grows_skips_and_backs_off():
    ref = train_reference(scaled_case())
    assert decisions(ref, "skipped") == [[0, 0], [0, 0], [1, 1], [0, 0]]
    assert decisions(ref, "scale") == [[2.0**16] * 2, [2.0**17] * 2, [2.0**18] * 2, [2.0**17] * 2]
    assert not all(torch.isfinite(g).all() for (s, p, _), g in ref.records.items() if s == 3 and p == "grads")
    for (s, p, n), after in ref.records.items():  # a skipped step leaves the parameters as they were
        if s == 3 and p == "params":
            assert torch.equal(after, ref.records[(2, "params", n)])


def test_infs_in_the_same_places_agree_and_others_do_not():
    ref = Trace("reference")
    ref.add(1, "grads", "w", torch.tensor([1.0, float("inf"), float("nan")]))
    for values, ok in [
        ([1.0, float("inf"), float("nan")], True),
        ([1.0, float("-inf"), float("nan")], False),
        ([1.0, float("nan"), float("inf")], False),
        ([1.5, float("inf"), float("nan")], False),
    ]:
        got = Trace("sharded")
        got.add(1, "grads", "w", torch.tensor(values))
        (finding,) = compare_traces(ref, got)
        assert finding.ok is ok, (values, finding)


def test_an_inf_or_nan_that_another_order_makes_is_allowed_and_no_other():
    """Where a partial sum overflows, the order of the reduction decides inf or NaN (60000 +
    60000 - 60000 - 60000 in fp16): an element may be what a numerically equivalent run made it
    (regression 1f67271198c5), never what none did, and never without calibration."""
    inf, nan = float("inf"), float("nan")
    ref = Trace("reference")
    ref.add(1, "grads", "w", torch.tensor([1.0, nan, inf, 2.0]))
    other_order = Trace("reference")
    other_order.add(1, "grads", "w", torch.tensor([1.0, inf, inf, 2.0]))
    for values, ok, strict_ok in [
        ([1.0, inf, inf, 2.0], True, False),  # as the other order has it: only with calibration
        ([1.0, nan, inf, 2.0], True, True),  # as the reference has it
        ([1.0, -inf, inf, 2.0], False, False),  # as no run has it
        ([1.0, inf, nan, 2.0], False, False),
        ([1.0, inf, inf, inf], False, False),  # an overflow no run shows
        ([1.5, inf, inf, 2.0], False, False),  # the finite rest is still measured
    ]:
        got = Trace("sharded")
        got.add(1, "grads", "w", torch.tensor(values))
        (finding,) = compare_traces(ref, got, calibrate=lambda: [other_order])
        assert finding.ok is ok, (values, finding)
        (strict,) = compare_traces(ref, got)
        assert strict.ok is strict_ok, (values, strict)


# ---- the correct engines ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("engine", "world_size"),
    [("fsdp2", 2), ("fsdp2", 3), (SHARDED_SCALER, 2), (SHARDED_SCALER, 3), ("fsdp1", 3), ("flat", 3)],
)
def test_a_step_skipped_on_every_rank_passes(fsdp_check, engine, world_size):
    """FSDP2 with torch.amp.GradScaler (DTensor all-reduces its found-inf flag) or with
    ShardedGradScaler; FSDP1 and the flat engine with ShardedGradScaler (plain-tensor shards)."""
    case = scaled_case(world_size, engine=engine, clip_norm=1e-2)
    ref = train_reference(case)
    assert [row[0] for row in decisions(ref, "skipped")] == [0, 0, 1, 0]
    verdict = fsdp_check(case)
    assert verdict.ok, verdict.summary()
    assert {f.step for f in verdict.findings if f.phase == "loss_scale"} == {1, 2, 3, 4}


def predivided_case(**changes) -> Case:
    """A one-layer MLP with an fp16 reduction whose scaled bias gradients are about -19000 and
    -19800 on the two ranks at step 2: their fp16 sum overflows, their halves' sum does not
    (found by the generated-case test below before the reference pre-divided)."""
    return Case(
        model=ModelSpec(kind="mlp", widths=(1, 2)),
        world_size=2,
        wrap=("",),
        precision=PrecisionSpec(param_dtype="fp16", reduce_dtype="fp16"),
        reshard_after_forward=False,
        data=DataSpec(batch_size=2),
        data_seed=0,
        steps=2,
        optim=OptimSpec(name="sgd", lr=1e-3, momentum=0.9, weight_decay=0.0),
        loss_scaling=LossScaleSpec(init_scale=8192.0, growth_factor=4.0, growth_interval=1),
        **changes,
    )


def test_fsdp2s_fp16_predivide_decides_the_skip(fsdp_check):
    """FSDP2 divides each rank's fp16 gradient by 2 before the SUM and the sum by world/2 after
    (`Arithmetic.divide_factors`); summing first overflows: the reference must divide as the
    engine does, or it skips a step the engine rightly takes."""
    case = predivided_case()
    predivided = train_reference(case)
    summed = train_reference(case, arithmetic=Arithmetic(predivide="never"))
    assert decisions(predivided, "skipped") == [[0, 0], [0, 0]]
    assert decisions(summed, "skipped") == [[0, 0], [1, 1]]
    verdict = fsdp_check(case)
    assert verdict.ok, verdict.summary()
    # The flat engine sums, then divides: its reference overflows (and skips) as it does.
    verdict = fsdp_check(case.with_(engine="flat"))
    assert verdict.ok, verdict.summary()
    assert [row["skipped"] for row in verdict.loss_scales] == [0, 1]


def test_divide_factors_are_torchs():
    fsdp2, fsdp1, flat = Arithmetic(), Arithmetic(predivide="always"), Arithmetic(predivide="never")
    assert [fsdp2.divide_factors(torch.float16, w) for w in (1, 2, 3, 4, 8)] == [
        (1.0, 1.0),
        (2.0, 1.0),
        (2.0, 1.5),
        (2.0, 2.0),
        (4.0, 2.0),
    ]
    assert fsdp2.divide_factors(torch.float32, 4) == flat.divide_factors(torch.float16, 4) == (1.0, 4.0)
    assert fsdp1.divide_factors(torch.float32, 4) == (2.0, 2.0)


# ---- the zoo's scaling bugs ---------------------------------------------------------------------
def test_one_rank_skipping_alone_is_caught_at_that_step(fsdp_check):
    """Inputs 100x larger: the first layer's gradient overflows first, in rows rank 0 holds and
    rank 1 does not (measured on the reference). The correct engine skips step 1 on both ranks;
    with the flag not all-reduced rank 1 steps."""
    case = scaled_case(2, data_scale=100.0, steps=2)
    ref = train_reference(case)
    assert decisions(ref, "skipped")[0] == [1, 1]
    assert fsdp_check(case).ok
    verdict = fsdp_check(case.with_(engine="fsdp_verify.zoo.mutants:inf_check_not_all_reduced"))
    first = verdict.first_divergence
    assert (first.step, first.phase, first.name) == (1, "loss_scale", "skipped"), verdict.summary()
    assert first.message.startswith("rank 1 stepped, the reference skips the step on every rank"), first.message
    grads = [f for f in verdict.findings if f.step == 1 and f.phase == "grads"]
    assert grads and all(f.ok for f in grads)  # the numbers up to the decision agree
    assert "(ranks: 65536 skipped, 65536 stepped)" in verdict.loss_scale_line(), verdict.loss_scale_line()


def test_unscaling_after_the_clip_is_caught_at_the_clip_norm(fsdp_check):
    case = scaled_case(2, clip_norm=1e-2, steps=2, engine="fsdp_verify.zoo.mutants:unscale_after_clipping")
    verdict = fsdp_check(case)
    first = verdict.first_divergence
    assert (first.step, first.phase) == (1, "grad_norm"), verdict.summary()
    assert first.ratio > 1e6  # the norm of the scaled gradients: 2**16 times the true one
    assert all(f.ok for f in verdict.findings if f.step == 1 and f.phase in ("grads", "loss_scale"))


@pytest.mark.parametrize("name", ["inf_check_not_all_reduced", "unscale_after_clipping"])
def test_the_mutants_draws_pass_on_the_correct_engine(name):
    """The draws that catch each mutant (tests/test_zoo.py: within 20) pass on FSDP2."""
    correct = replace(BY_NAME[name], name="correct", engine="fsdp2")
    result = hunt(correct, 6, world_sizes=(2,))
    assert (result.status, result.examples) == ("uncaught", 6), result.detail


# ---- the command line ---------------------------------------------------------------------------
def test_check_shows_the_scale_and_the_skips(capsys, tmp_path):
    args = ["check", "--model", "mlp", "--param-dtype", "fp16", "--steps", "4", "--no-calibrate"]
    args += ["--json", str(tmp_path / "verdict.json")]
    assert main(args + ["--loss-scaling", "init_scale=65536,growth_interval=1"]) == 0
    rows = json.loads((tmp_path / "verdict.json").read_text())["loss_scales"]
    assert [(r["scale"], r["skipped"]) for r in rows] == [(65536, 0), (131072, 0), (262144, 1), (131072, 0)]
    assert all(r["ranks"] == [[r["scale"], r["skipped"]]] * 2 for r in rows)
    out = capsys.readouterr().out
    assert "loss_scale" in out  # the table's column
    assert "loss scale per step (the reference; every rank agrees unless listed):" in out
    assert "1: 65536 stepped; 2: 131072 stepped; 3: 262144 skipped; 4: 131072 stepped" in out, out
    assert "loss scale 65536 (x2 after 1 good steps, x0.5 on inf/NaN)" in out


@pytest.mark.parametrize(
    ("value", "field"),
    [("growth_interval=0", "loss_scaling.growth_interval"), ("init_scal=8", "loss_scaling.init_scal"), ("8", "")],
)
def test_check_names_a_bad_loss_scaling_field(capsys, value, field):
    assert main(["check", "--param-dtype", "fp16", "--loss-scaling", value]) == 2
    err = capsys.readouterr().err
    assert f"bad case: {field or 'loss_scaling'}:" in err, err


@pytest.mark.parametrize(
    "precision",
    [[], ["--param-dtype", "bf16"], ["--param-dtype", "bf16", "--reduce-dtype", "fp32"], ["--output-dtype", "bf16"]],
    ids=["fp32", "bf16", "bf16-fp32-reduce", "bf16-output"],
)
def test_loss_scaling_without_fp16_is_bad_input(capsys, precision):
    """Before, `--loss-scaling` with bf16 or fp32 ran without a word (a scaler that only multiplies
    and divides by powers of two in a range that needs none). Refused as fuzz and sweep refuse it."""
    assert main(["check", *precision, "--loss-scaling", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "bad case: loss_scaling: expected null unless the case computes in fp16" in err, err
    assert "(from --loss-scaling)" in err and "with precision " in err


def test_a_case_file_with_loss_scaling_and_no_fp16_is_bad_input(tmp_path, capsys):
    path = tmp_path / "case.json"
    Case(model=ModelSpec(kind="mlp"), precision=FP16, loss_scaling=LossScaleSpec()).save(path)
    assert main(["check", "--case", str(path), "--param-dtype", "bf16"]) == 2  # the file's scaling stays
    assert "loss_scaling: expected null unless the case computes in fp16" in capsys.readouterr().err
    data = json.loads(path.read_text())
    data["precision"] = {"param_dtype": None, "reduce_dtype": None, "output_dtype": None, "cast_forward_inputs": True}
    path.write_text(json.dumps(data))
    with pytest.raises(CaseError, match="loss_scaling: expected null unless"):
        Case.load(path)
    # fp16 anywhere (here only the reduction) is what scaling is for: taken.
    assert Case(precision=PrecisionSpec(reduce_dtype="fp16"), loss_scaling=LossScaleSpec()).loss_scaling


def test_shrinking_fp16_away_drops_the_loss_scaling_with_it():
    from fsdp_verify.repro.shrink import _precision, _valid

    case = Case(model=ModelSpec(kind="mlp"), precision=FP16, loss_scaling=LossScaleSpec())
    valid = dict(_valid(case, _precision(case)))
    to_fp32 = valid["precision (param fp16, reduce fp32) -> fp32"]
    assert to_fp32.precision.is_full_precision and to_fp32.loss_scaling is None
    assert valid["precision.param_dtype fp16 -> None"].loss_scaling is None


def test_fuzz_draws_fp16_with_loss_scaling(tmp_path, capsys):
    code = main(
        ["fuzz", "--engine", "fsdp2", "--precisions", "fp16", "--world-sizes", "2", "--models", "mlp"]
        + ["--max-examples", "3", "--seed", "7", "--out", str(tmp_path), "--no-progress"]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "fp16 loss scaling: 3 cases" in out, out


def test_a_sweeps_rows_say_how_many_fp16_steps_were_skipped(tmp_path, capsys):
    """The nightly's rows carry each loss-scaled case's steps, skips and scales (schema-valid), and
    its summary adds them up, so a night shows whether its fp16 cases overflowed at all."""
    from fsdp_verify.reports.schema import validate

    code = main(
        ["sweep", "--engine", "fsdp2", "--precisions", "fp16", "--world-sizes", "2", "--models", "mlp"]
        + ["--cases", "4", "--seed", "7", "--out", str(tmp_path), "--no-progress"]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    report = json.loads((tmp_path / "report.json").read_text())
    validate(report)
    tallies = [row["loss_scale"] for row in report["cases"]]
    assert [t["steps"] for t in tallies] == [row["steps"] for row in report["cases"]]
    skipped, steps = sum(t["skipped"] for t in tallies), sum(t["steps"] for t in tallies)
    assert 0 < skipped < steps, tallies  # this seed's draw overflows on some steps, not all
    assert f"fp16 loss scaling: 4 cases, {skipped} of {steps} steps skipped by the reference" in out, out


def test_loss_scaling_pins_are_checked_before_drawing():
    with pytest.raises(CaseError, match="loss_scaling.growth_interval"):
        cases(precisions=("fp16",), **{"loss_scaling.growth_interval": 0})
    with pytest.raises(PinError, match="fp16 cases only"):
        cases(precisions=("fp32",), **{"loss_scaling.init_scale": 8.0})


# ---- generated cases ----------------------------------------------------------------------------
@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(cases(world_sizes=(1, 2, 3, 4), precisions=("fp16",), steps=st.integers(1, 3)))
@example(regression("1f67271198c5"))  # ws 4, fp16 reduction: NaN in the emulation's order, inf in gloo's
def test_generated_fp16_loss_scaled_cases_pass_on_fsdp2(fsdp_check, case):
    assert case.loss_scaling is not None
    verdict = fsdp_check(case)
    assert verdict.ok, verdict.summary()
