"""Every Case field from the command line (verify/commands/case_flags.py): a flag for each field,
a drawn case rebuilt from its flags alone hash for hash, flags over a case file, bad values named
by flag and field, and the same names as draw options (fuzz, sweep) and strategy keywords.
(Parsing and drawing only: no rank runs here.)"""

import dataclasses
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fsdp_verify.case import Case, CaseError
from fsdp_verify.case_specs import DataSpec, LossScaleSpec, OptimSpec, PrecisionSpec
from fsdp_verify.commands import case_flags
from fsdp_verify.commands.case_flags import case_to_flags, flag_of
from fsdp_verify.commands.cli import build_parser, main
from fsdp_verify.commands.options import case_from_args, strategy_from_args
from fsdp_verify.dims.registry import packages
from fsdp_verify.models import ModelSpec
from fsdp_verify.properties.draw import draw_cases
from fsdp_verify.properties.pins import PinError
from fsdp_verify.properties.strategies import cases

USER = "tests/user/models.py"
STEPS = "tests/user/steps.py"


def parse(*flags: str) -> Case:
    return case_from_args(build_parser().parse_args(["check", *flags]))


def test_every_field_of_a_case_and_its_specs_has_a_flag_and_check_help_lists_it(capsys):
    """A new Case field without a flag fails here (introspected, not listed by hand)."""
    nested = {"model": ModelSpec, "precision": PrecisionSpec, "optim": OptimSpec, "data": DataSpec}
    nested["loss_scaling"] = LossScaleSpec
    paths = [f.name for f in dataclasses.fields(Case)]
    paths += [f"{head}.{f.name}" for head, spec in nested.items() for f in dataclasses.fields(spec)]
    paths += [f"dims.{p.name}.{f.name}" for p in packages() for f in dataclasses.fields(p.spec)]
    missing = [p for p in paths if flag_of(p) is None and p not in ("model", "precision", "optim", "data", "dims")]
    assert not missing, f"Case fields without a flag in verify/commands/case_flags.py: {missing}"
    with pytest.raises(SystemExit):
        main(["check", "--help"])
    text = capsys.readouterr().out
    for f in case_flags.FLAGS:
        assert f.flag in text and f"\n{f.group}:" in text, f.flag


ENGINES = ("fsdp2", "fsdp1", "flat", "fsdp_verify.zoo.mutants:grads_divided_twice")
DRAWS = {
    "fsdp2-fp16": cases(engine=ENGINES[0], precisions=("fp32", "bf16", "fp16")),
    "fsdp1": cases(engine="fsdp1", precisions=("bf16",)),
    "flat": cases(engine="flat", world_sizes=(2, 3)),
    "mutant-default-plan": cases(engine=ENGINES[3], wrap=st.sampled_from((None, ("",)))),
    "hsdp": cases(hsdp=True, world_sizes=(4,), precisions=("fp32", "fp16")),
    "meshes-adam": cases(
        precisions=("fp16",),
        mesh_shape=st.sampled_from(((2,), (2, 2), (1, 4))),
        **{"optim.eps": st.sampled_from((1e-8, 1e-6)), "optim.betas": st.sampled_from(((0.9, 0.999), (0.8, 0.95)))},
    ),
    "user-model": cases(model=f"{USER}:user_lm", model_kwargs={"n_layers": 2}, shrinkable="n_layers", world_sizes=(2,)),
    "user-data-loss": cases(
        custom_model=ModelSpec(kind="custom", factory=f"{USER}:dict_lm", output_fn=f"{USER}:scores", seq_len=5),
        world_sizes=(2,),
        loss=f"{USER}:smoothed_loss",
        **{"data.fn": f"{USER}:reversal_data", "model.seq_len": 5},
    ),
    "user-step": cases(
        model=f"{USER}:user_lm", init_fn=f"{USER}:normal_init", step=f"{STEPS}:train_step", world_sizes=(1, 2)
    ),
}


@pytest.mark.parametrize("name", DRAWS)
def test_a_drawn_case_is_rebuilt_from_its_flags_alone(name):
    """Engines, HSDP and 1-D meshes, fp16 loss scaling, user models, data, losses and steps:
    `check FLAGS` builds the same case, hash for hash (what --save-case writes, --print-flags
    prints)."""

    @settings(max_examples=25, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(DRAWS[name])
    def rebuilt_from_flags(case):
        flags = case_to_flags(case)
        rebuilt = parse(*flags)
        assert rebuilt.hash == case.hash, (flags, case.to_json(), rebuilt.to_json())
        assert rebuilt == case

    rebuilt_from_flags()


def test_print_flags_prints_the_command_that_rebuilds_a_saved_case(tmp_path, capsys):
    path = tmp_path / "case.json"
    Case(
        model=ModelSpec(kind="mlp", widths=(5, 7, 3)),
        world_size=4,
        mesh_shape=(2, 2),
        reshard_after_forward=2,
        optim=OptimSpec(name="sgd", lr=0.5, momentum=0.0),
        microbatches=2,
        sync_every_microbatch=False,
        clip_norm=0.25,
        init="meta",
        precision=PrecisionSpec(param_dtype="fp16", reduce_dtype="fp32", cast_forward_inputs=False),
        loss_scaling=LossScaleSpec(init_scale=1024.0, growth_interval=1),
        data=DataSpec(batch_size=16, kind="cancellation", scale=0.01),
    ).save(path)
    assert main(["check", "--case", str(path), "--print-flags"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("fsdp-verify check --model mlp --widths 5,7,3 --mesh-shape 2,2 ")
    assert "--sync-last" in line and "--init meta" in line and "--loss-scaling --init-scale 1024.0" in line
    again = tmp_path / "again.json"
    assert main(["check", *line.split()[2:], "--save-case", str(again), "--print-flags"]) == 0
    assert Case.load(again).hash == Case.load(path).hash


def test_flags_override_a_case_file_and_keep_its_other_fields(tmp_path):
    path = Case(model=ModelSpec(kind="mlp"), steps=1, optim=OptimSpec(name="sgd"), seed=7).save(tmp_path / "c.json")
    case = parse("--case", str(path), "--lr", "0.5", "--sync-last", "--mesh-shape", "2,2", "--microbatches", "2")
    assert (case.optim.name, case.optim.lr, case.seed, case.steps) == ("sgd", 0.5, 7, 1)
    assert case.sync_every_microbatch is False and case.mesh_shape == (2, 2) and case.world_size == 4
    assert case.data.batch_size % 8 == 0  # rounded up to world size x micro-batches
    back = parse("--case", str(path), "--sync-last", "false", "--optimizer", "adam", "--clip-norm", "none")
    assert back.sync_every_microbatch and back.optim.name == "adam" and back.clip_norm is None
    scaled = parse("--case", str(path), "--param-dtype", "float16", "--growth-interval", "3")
    assert scaled.precision.param_dtype == "fp16" and scaled.loss_scaling == LossScaleSpec(growth_interval=3)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--lr", "-1"], "optim.lr: expected a positive learning rate, got -1 (from --lr)"),
        (
            ["--optimizer", "lamb"],
            "optim.name: expected one of ('sgd', 'adam', 'adamw', 'adagrad', 'rmsprop'), got 'lamb' (from --optimizer)",
        ),
        (
            ["--mesh-shape", "2,3", "--world-size", "4"],
            "mesh_shape: expected dimensions whose product is world_size=4, got (2, 3) (from --mesh-shape)",
        ),
        (["--init", "lazy"], "init: expected one of ('eager', 'meta'), got 'lazy' (from --init)"),
        (["--betas", "0.9,1.5"], "optim.betas: expected two values in [0, 1), got (0.9, 1.5) (from --betas)"),
        (
            ["--growth-factor", "0.5"],
            "loss_scaling.growth_factor: expected a factor above 1, got 0.5 (from --growth-factor)",
        ),
        (["--loss-scaling", "off", "--init-scale", "8"], "--init-scale: expected no loss scaling field"),
        (
            ["--data-kind", "cancellation"],
            "data.kind: expected 'normal' for a transformer (token ids cannot cancel), got 'cancellation' (from --data-kind)",
        ),
    ],
)
def test_a_bad_value_exits_2_naming_the_field_what_was_expected_and_the_flag(flags, message, capsys):
    assert main(["check", *flags]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--reshard-after-forward", "maybe"], "argument --reshard-after-forward: expected true, false or a positive"),
        (["--sync-last", "sometimes"], "argument --sync-last: expected true or false, got 'sometimes'"),
        (["--mesh-shape", "2x2"], "argument --mesh-shape: expected SHARD or REPLICATE,SHARD"),
        (["--lr", "fast"], "argument --lr: expected a number, got 'fast'"),
        (["--reduce-dtype", "fp8"], "argument --reduce-dtype: expected a dtype (fp32/float32"),
    ],
)
def test_a_value_that_does_not_parse_is_a_usage_error_naming_the_flag(flags, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["check", *flags])
    assert e.value.code == 2 and message in capsys.readouterr().err


def _sweep_args(*flags: str):
    return build_parser().parse_args(["sweep", "--out", "unused", *flags])


def test_fuzz_and_sweep_take_the_same_flags_to_pin_a_field_or_draw_among_values():
    args = ["--optimizer", "adam", "sgd", "--sync-last", "--mesh-shape", "2,2", "--lr", "0.5", "--clip-norm", "none"]
    drawn = draw_cases(strategy_from_args(_sweep_args(*args)), 30, 0)
    assert {c.optim.name for c in drawn} == {"adam", "sgd"}
    assert all(not c.sync_every_microbatch and c.mesh_shape == (2, 2) and c.world_size == 4 for c in drawn)
    assert all(c.optim.lr == 0.5 and c.clip_norm is None for c in drawn)
    drawn = draw_cases(strategy_from_args(_sweep_args("--reshard-after-forward", "false", "--steps", "1", "2")), 30, 0)
    assert {c.steps for c in drawn} == {1, 2} and all(c.reshard_after_forward is False for c in drawn)
    fp16 = draw_cases(strategy_from_args(_sweep_args("--precisions", "fp16", "--growth-interval", "1")), 10, 0)
    assert all(c.loss_scaling.growth_interval == 1 for c in fp16)
    assert draw_cases(strategy_from_args(_sweep_args()), 10, 0) == draw_cases(cases(), 10, 0)  # no flag: the old draw


def test_a_sweep_runs_its_draw_flags_and_records_them(tmp_path, capsys):
    args = ["sweep", "--world-sizes", "2", "--models", "mlp", "--optimizer", "sgd", "--steps", "1", "--sync-last"]
    assert main([*args, "--cases", "2", "--no-progress", "--out", str(tmp_path)]) == 0, capsys.readouterr()
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["counts"]["cases"] == 2
    assert report["draw"]["flags"] == ["--optimizer sgd", "--steps 1", "--sync-last"]


def test_a_draw_value_no_case_can_hold_is_bad_input_before_any_draw(tmp_path, capsys):
    """`--optimizer adam lamb` would discard every draw holding lamb: named now, exit 2."""
    assert main(["fuzz", "--optimizer", "adam", "lamb", "--out", str(tmp_path)]) == 2
    assert (
        "optim.name: expected one of ('sgd', 'adam', 'adamw', 'adagrad', 'rmsprop'), got 'lamb' (from --optimizer)"
        in capsys.readouterr().err
    )
    assert main(["sweep", "--steps", "0", "--out", str(tmp_path)]) == 2
    assert "steps: expected a positive integer, got 0 (from --steps)" in capsys.readouterr().err
    with pytest.raises(CaseError, match=r"^reshard_after_forward: expected true, false or a positive int, got 0"):
        cases(reshard_after_forward=[True, 0])
    with pytest.raises(CaseError, match=r"^optim.lr: expected a positive learning rate"):
        cases(**{"optim.lr": -1.0})


def test_a_mesh_no_world_size_can_hold_is_bad_input(tmp_path, capsys):
    args = ["sweep", "--mesh-shape", "2,2", "--world-sizes", "2", "--cases", "1", "--out", str(tmp_path)]
    assert main(args) == 2
    assert "--mesh-shape: meshes of [4] ranks, none among --world-sizes [2]" in capsys.readouterr().err


@settings(max_examples=30, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(cases(optimizer=["adam", "sgd"], sync_last=True, mesh_shape="2,2", lr=0.5, reduce_dtype="float32"))
def test_the_strategies_take_the_flag_names_as_keywords(case):
    assert case.optim.name in ("adam", "sgd") and case.optim.lr == 0.5 and not case.sync_every_microbatch
    assert case.mesh_shape == (2, 2) and case.world_size == 4
    assert case.precision.reduce_dtype == "fp32"  # "float32", read as --reduce-dtype reads it


def test_a_keyword_list_draws_among_values_or_is_one_tuple_value():
    from fsdp_verify.commands.case_flags import keyword_pins

    pins = keyword_pins({"frozen": ["a", "b"], "betas": [0.8, 0.9], "mesh_shape": [(2, 2), "1,4"]}, set())
    assert pins["model.frozen"] == ("a", "b") and pins["optim.betas"] == (0.8, 0.9)
    assert set(draw_cases(pins["mesh_shape"], 20, 0)) == {(2, 2), (1, 4)}
    assert keyword_pins({"frozen": [], "sync_last": True}, set()) == {
        "model.frozen": (),
        "sync_every_microbatch": False,
    }
    with pytest.raises(TypeError, match=r"^optimizer: expected a value or a non-empty list"):
        keyword_pins({"optimizer": []}, set())


def test_the_strategies_take_a_user_model_as_check_model_does():
    """`model="file.py:NAME"` (what `check --model` takes) with `model_kwargs`, or a ModelSpec;
    any other value is a TypeError naming the argument, not an AttributeError inside a draw."""
    (case,) = draw_cases(cases(model=f"{USER}:user_lm", model_kwargs='{"n_layers": 3}', world_sizes=(2,)), 1, 0)
    assert case.model.factory == f"{USER}:user_lm" and case.model.kwargs == {"n_layers": 3}
    spec = ModelSpec(kind="custom", factory=f"{USER}:user_lm")
    (case,) = draw_cases(cases(model=spec, world_sizes=(2,)), 1, 0)
    assert case.model.factory == spec.factory
    assert {c.model.kind for c in draw_cases(cases(model="mlp"), 5, 0)} == {"mlp"}
    with pytest.raises(TypeError, match=r"^model: expected 'mlp', 'transformer', a model factory 'pkg.module:NAME'"):
        cases(model="user_lm")
    with pytest.raises(TypeError, match="^model: expected .* got int 3"):
        cases(model=3)
    with pytest.raises(TypeError, match=r"^model_kwargs: only with a user's model"):
        cases(model_kwargs={"n_layers": 3})


def test_the_pytest_fixture_takes_a_user_model_and_flag_names(fsdp_cases):
    strategy = fsdp_cases(model=f"{USER}:user_lm", model_kwargs={"n_layers": 2}, world_sizes=(2,), optimizer="sgd")
    (case,) = draw_cases(strategy, 1, 0)
    assert case.model.kwargs == {"n_layers": 2} and case.optim.name == "sgd"
    with pytest.raises(PinError, match="'optimiser'"):
        fsdp_cases(optimiser="sgd")


def test_flag_text_round_trips_json_types():
    for value in (1, 1.0, 1e-08, 0.1, True, False, None, (2, 2), (), 65536.0, {"a": [1, 2]}):
        assert json.dumps(value) == json.dumps(_read(value)), value


def _read(value):
    """What the flag parsers make of the text of `value` (as case_to_flags writes it)."""
    from fsdp_verify.commands import flag

    text = flag.text(value)
    if isinstance(value, bool):
        return flag.boolean(text)
    if isinstance(value, dict):
        return json.loads(text)
    if isinstance(value, tuple):
        return flag.or_none(flag.integers)(text) or ()
    return flag.or_none(flag.number)(text)
