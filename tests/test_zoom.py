"""Zoom (verify/zoom/, docs/zoom.md): for every zoo mutant that corrupts the forward or backward
computation and for three bugs planted in a user's model, the module and the op the zoom names are
the ones the bug is in; a passing case zoomed names nothing."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from fsdp_verify.case import Case, ModelSpec
from fsdp_verify.case_specs import DataSpec, PrecisionSpec
from fsdp_verify.runner import check_case
from fsdp_verify.zoom.locate import zoom
from tests.conftest import lm_case, mlp_case

USER = "tests/user/models.py"


def _mutant(name: str) -> str:
    return f"fsdp_verify.zoo.mutants:{name}"


def _user(factory: str) -> Case:
    model = ModelSpec(kind="custom", factory=f"{USER}:{factory}", seq_len=6)
    return Case(world_size=2, data=DataSpec(batch_size=4), steps=1, model=model, wrap=("UserBlock", ""))


def _dropout(engine: str) -> Case:
    return mlp_case(2, engine=_mutant(engine)).with_(**{"model.dropout": 0.2})


BF16 = PrecisionSpec(param_dtype="bf16", reduce_dtype="fp32")
# bug -> (case, where the bug is: direction, module, op, where the op is named)
BUGS = {
    # A forward pre-hook on the root casts the input: the root's own forward, the cast only the rank runs.
    "inputs_cast_to_bf16": (
        lambda: mlp_case(2, engine=_mutant("inputs_cast_to_bf16")),
        ("forward", "", "aten._to_copy.default", "only on the sharded side"),
    ),
    # A rank reseeded before the forward: the first dropout draws another mask.
    "same_dropout_mask_on_every_rank": (
        lambda: _dropout("same_dropout_mask_on_every_rank"),
        ("forward", "layers.0.dropout", "aten.bernoulli_.float", "parts"),
    ),
    # Recomputation without the RNG state: the dropout's backward multiplies by a new mask.
    "checkpoint_without_rng_state": (
        lambda: _dropout("checkpoint_without_rng_state"),
        ("backward", "layers.1.dropout", "aten.mul.Tensor", "parts"),
    ),
    # An autograd node on the root's output scales the gradient on rank 1: the root's backward.
    "rank1_grad_off_by_2e6_once": (
        lambda: mlp_case(2, engine=_mutant("rank1_grad_off_by_2e6_once")),
        ("backward", "", "aten.mul.Tensor", "only on the sharded side"),
    ),
    # RoPE frequencies zeroed off rank 0: a buffer of the root, passed down to every block and its
    # attention (so their inputs part on the way in): the root, and inside it the rotation's mul.
    "buffer_uninitialised_off_rank0": (
        lambda: lm_case(2, engine=_mutant("buffer_uninitialised_off_rank0")),
        ("forward", "", "aten.mul.Tensor", "parts"),
    ),
    "user: buffer cast to bf16": (
        lambda: _user("buffer_cast_to_bf16"),
        ("forward", "blocks.1", "aten.mul.Tensor", "parts"),
    ),
    "user: forward reads the rank": (
        lambda: _user("forward_reads_rank"),
        ("forward", "blocks.0.down.1", "aten.add.Tensor", "parts"),
    ),
    "user: backward hook on rank 1 only": (
        lambda: _user("hook_on_one_rank"),
        ("backward", "blocks.1.up", "aten.mul.Tensor", "only on the sharded side"),
    ),
}


@pytest.mark.parametrize("bug", list(BUGS))
def test_zoom_names_the_module_and_the_op_the_bug_is_in(bug, tmp_path):
    make, (direction, module, op, where) = BUGS[bug]
    case = make()
    verdict = check_case(case)
    assert not verdict.ok
    result = zoom(case, verdict, out_dir=tmp_path)
    assert (result.direction, result.module, result.op, result.op_where) == (direction, module, op, where), (
        result.chain()
    )
    saved = load_file(result.saved)
    assert any(k.startswith("sharded.output") for k in saved)
    if where == "parts":  # both sides ran it: both sides' outputs are there to compare by hand
        assert any(k.startswith("reference.output") for k in saved)
    assert f"module {module!r}" in result.chain() or (module == "" and "(the root)" in result.chain())


def test_param_dtype_ignored_is_named_by_the_precision_contract_not_the_zoom():
    """Forward and backward in fp32 against bf16: every value within one bf16 rounding of the
    reference's (the bound allows one), so no module's output parts; the precision contract is
    what names the bug, and the zoom must not invent a module."""
    case = mlp_case(2, engine=_mutant("param_dtype_ignored"), precision=BF16)
    verdict = check_case(case)
    assert verdict.first_divergence.phase == "precision"
    assert not zoom(case, verdict).named


@pytest.mark.parametrize(
    "case",
    [
        mlp_case(2, seed=20263001),
        lm_case(3, seed=20263002, precision=BF16),
        mlp_case(2, seed=20263003).with_(**{"model.dropout": 0.2}),
    ],
    ids=["mlp-fp32", "lm-bf16-3-ranks", "mlp-dropout"],
)
def test_a_passing_case_zoomed_names_nothing(case):
    case = case.with_(engine="fsdp2")
    verdict = check_case(case)
    assert verdict.ok
    result = zoom(case, verdict, step=case.steps)
    assert not result.named and result.modules, result.chain()
    assert all(row["ok"] for row in result.modules)


def test_a_reassociated_dot_product_on_one_rank_is_not_named():
    """Rank 1's up projections sum their dot products in reverse order: its module outputs and
    gradients move (a held-to-exact comparison names `blocks.0.up`, checked by hand), but by less
    than the derived bound, so the zoom names nothing at that step."""
    case = _user("reassociated_on_rank1")
    result = zoom(case, step=1)
    assert not result.named, result.chain()
    moved = [m for m in result.modules if (m["forward"] or 0) > 0 or (m["backward"] or 0) > 0]
    assert any(m["module"] == "blocks.0.up" for m in moved) and all(m["ok"] for m in result.modules)


@pytest.mark.parametrize("step", [1, 2])
def test_zoom_into_a_resumed_case_before_and_after_the_save(step):
    """Issue 48: a resumed case (saved after step 1 on 2 ranks, resumed on 1). Step 1 is the first
    run's: zoomed as the case without its resume (it failed before: `steps=1` beside
    `resume_after=1` is no case). Step 2 is the resumed run's: the ranks save and resume as the case
    does and the reference's resumed run is watched (before, the ranks ran on without a resume
    and the reference watched nothing after it: "every module agrees", a silent miss)."""
    case = mlp_case(2, steps=2, resume_after=1, resume_world_size=1, engine=_mutant("inputs_cast_to_bf16"))
    verdict = check_case(case)
    assert not verdict.ok
    result = zoom(case, verdict, step=step)
    assert (result.direction, result.module, result.op, result.op_where) == (
        "forward",
        "",
        "aten._to_copy.default",
        "only on the sharded side",
    ), result.chain()
    assert result.chain().startswith(f"step {step} ->")


def test_zoom_refuses_a_step_outside_the_case():
    from fsdp_verify.validation import CaseError

    with pytest.raises(CaseError, match="zoom"):
        zoom(mlp_case(2), step=5)
    with pytest.raises(CaseError, match="zoom"):
        Case(zoom="one/forward")


def test_check_zoom_prints_the_chain_and_the_report_carries_it(tmp_path, capsys):
    """`check --zoom --out`: the terminal chain; report.json's case row holds the zoom and
    validates against the schema; report.html shows the module tree and the op table."""
    import json

    import jsonschema

    from fsdp_verify.commands.cli import main
    from fsdp_verify.reports.schema import SCHEMA_PATH

    args = ["check", "--model", "tests/user/models.py:forward_reads_rank", "--wrap", "UserBlock"]
    args += ["--steps", "1", "--seq-len", "6", "--zoom", "--out", str(tmp_path)]
    assert main(args) == 1
    out = capsys.readouterr().out
    assert "Zoom: step 1 -> " in out and "forward of module 'blocks.0.down.1'" in out and "aten.add.Tensor" in out
    report = json.loads((tmp_path / "report.json").read_text())
    jsonschema.validate(report, json.loads(SCHEMA_PATH.read_text()))
    zoomed = report["cases"][0]["zoom"]
    assert (zoomed["module"], zoomed["op"], zoomed["rank"]) == ("blocks.0.down.1", "aten.add.Tensor", 1)
    page = (tmp_path / "report.html").read_text()
    assert 'data-plot="zoom-modules"' in page and "id=zoom-ops" in page
    broken = dict(report, cases=[dict(report["cases"][0], zoom={**zoomed, "module": 3})])
    with pytest.raises(jsonschema.ValidationError):  # the schema does hold the zoom's fields
        jsonschema.validate(broken, json.loads(SCHEMA_PATH.read_text()))


def test_fuzz_zooms_into_the_shrunk_case(tmp_path, capsys):
    from fsdp_verify.commands.cli import main

    args = ["fuzz", "--engine", _mutant("inputs_cast_to_bf16"), "--models", "mlp", "--world-sizes", "2"]
    assert main(args + ["--max-examples", "3", "--no-progress", "--out", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert out.index("Shrunk case written") < out.index("Zoom: step 1 -> ")
    assert "forward of module '' (the root)" in out and "aten._to_copy.default" in out
    assert list(tmp_path.glob("zoom-*-op.safetensors"))


def test_the_zoom_command_takes_a_case_file_and_refuses_bad_input(tmp_path, capsys):
    from fsdp_verify.commands.cli import main

    path = _user("forward_reads_rank").save(tmp_path / "case.json")
    code = main(["zoom", str(path), "--trust-code", "--out", str(tmp_path), "--json", str(tmp_path / "z.json")])
    out = capsys.readouterr().out
    assert code == 1 and "Zoom: step 1 -> " in out and "'blocks.0.down.1'" in out
    assert '"module": "blocks.0.down.1"' in (tmp_path / "z.json").read_text()
    assert main(["zoom", str(tmp_path / "missing.json")]) == 2
    assert main(["zoom", str(path), "--trust-code", "--step", "7"]) == 2
    assert "zoom: expected a step in 1..1, got 7" in capsys.readouterr().err
