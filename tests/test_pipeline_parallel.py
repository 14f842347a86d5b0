"""Issue 40, pipeline parallelism (docs/pipeline-parallel.md): the model cut into stages over a pp
mesh dim, FSDP2 inside each stage, torch.distributed.pipelining's schedules, against a reference
that trains the unsplit model on the same micro-batches with the schedule's loss scaling
(reference/pipeline_parallel.py). Correct runs are bit-exact; each mutant is caught; pp is
opt-in for a plug-in engine; a user's split is code named by the case (verify/trust.py)."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings

from fsdp_verify.case import Case
from fsdp_verify.case_specs import DataSpec, LossScaleSpec, PrecisionSpec
from fsdp_verify.commands.cli import main
from fsdp_verify.engines.contracts import case_contracts
from fsdp_verify.models import ModelSpec
from fsdp_verify.properties.draw import draw_cases
from fsdp_verify.properties.strategies import cases
from fsdp_verify.runner import refuse_untakeable
from fsdp_verify.validation import CaseError

EVERYTHING = "examples/engine/my_engine.py:shard_everything"
BF16 = PrecisionSpec(param_dtype="bf16", reduce_dtype="fp32")
MLP5 = ModelSpec(kind="mlp", widths=(16, 33, 17, 9, 8))  # four blocks: four stages, or two a rank
LM4 = ModelSpec(kind="transformer", vocab_size=31, dim=16, n_layers=4, n_heads=2, ffn_hidden=23, seq_len=6)


def pp_case(world: int, pp: int, schedule: str = "1f1b", model=MLP5, mesh=None, precision=None, m: int = 4, **kw):
    return Case(
        model=model,
        world_size=world,
        mesh_shape=mesh,
        pp=pp,
        pp_schedule=schedule,
        microbatches=m,
        sync_every_microbatch=False,
        precision=precision or PrecisionSpec(),
        data=DataSpec(batch_size=(world // pp) * m * 2),
        **{"steps": 2, **kw},
    )


def _inexact(verdict) -> list:
    return [(f.key, f.max_abs) for f in verdict.findings if f.phase != "param_sums" and f.max_abs not in (0, None)]


def _tolerances_sane(verdict) -> None:
    """The calibration's numerically equivalent runs agree about as a float's last digits do: a
    tolerance of order 1 would mean one of them is not equivalent, and would hide bugs."""
    worst = max((f.tolerance for f in verdict.findings if f.phase == "grads" and f.tolerance), default=0)
    assert worst < 1e-3, worst


# ---- correct runs: bit-exact -------------------------------------------------------------------------
CI_MATRIX = [
    pytest.param(4, 2, "1f1b", MLP5, None, None, id="pp2-1f1b-dp2-mlp-fp32"),
    pytest.param(2, 2, "interleaved1f1b", LM4, None, BF16, id="pp2-interleaved-lm-bf16"),
]
NIGHTLY_MATRIX = [
    pytest.param(
        world,
        pp,
        schedule,
        model,
        mesh,
        precision,
        id=f"w{world}-pp{pp}-{schedule}-{name}-{p}{'-hsdp' if mesh else ''}",
    )
    for world, pp, mesh in ((2, 2, None), (4, 2, None), (4, 2, (1, 2)), (4, 4, None))
    for schedule in ("gpipe", "1f1b", "interleaved1f1b")
    if not (pp == 4 and schedule == "interleaved1f1b")  # eight stages: more than the models' blocks
    for name, model in (("mlp", MLP5), ("lm", LM4))
    for p, precision in (("fp32", None), ("bf16", BF16))
]


@pytest.mark.parametrize(("world", "pp", "schedule", "model", "mesh", "precision"), CI_MATRIX)
def test_correct_pipeline_parallelism_is_bit_exact(fsdp_check, world, pp, schedule, model, mesh, precision):
    verdict = fsdp_check(pp_case(world, pp, schedule, model, mesh, precision))
    assert verdict.ok, verdict.summary()
    assert not _inexact(verdict)
    _tolerances_sane(verdict)


@pytest.mark.slow
@pytest.mark.parametrize(("world", "pp", "schedule", "model", "mesh", "precision"), NIGHTLY_MATRIX)
def test_correct_pipeline_parallelism_is_bit_exact_everywhere(fsdp_check, world, pp, schedule, model, mesh, precision):
    verdict = fsdp_check(pp_case(world, pp, schedule, model, mesh, precision), calibrate=False)
    assert verdict.ok, verdict.summary()
    assert not _inexact(verdict)


EXPERTS = [
    pytest.param(2, 2, "gpipe", None, None, 4, id="pp2-gpipe-4-experts-fp32"),
    pytest.param(4, 2, "1f1b", (1, 2), PrecisionSpec(param_dtype="bf16"), 3, id="pp2-1f1b-hsdp-3-experts-bf16"),
]


@pytest.mark.parametrize(("world", "pp", "schedule", "mesh", "precision", "experts"), EXPERTS)
def test_routed_experts_in_a_stage_are_bit_exact(fsdp_check, world, pp, schedule, mesh, precision, experts):
    """The per-expert loop (top-1) trains in its stage as any module does, an expert no sample of a
    rank's micro-batch reached included (sweep 9103, fuzz 9104: 362 cases, bit-exact)."""
    model = replace(MLP5, experts=experts)
    verdict = fsdp_check(pp_case(world, pp, schedule, model, mesh, precision), calibrate=False)
    assert verdict.ok, verdict.summary()
    assert not _inexact(verdict)
    assert any(k[2].startswith("moe.experts.") for k in (f.key for f in verdict.findings if f.phase == "grads"))


def test_routed_experts_are_drawn_in_stages_but_not_where_fsdp2_cannot_accumulate_them():
    """Drawn pipelined with experts; not where a stage's accumulation without sync meets PyTorch's
    bug (an expert first reached in the last micro-batch brings a param_dtype gradient among the
    fp32 ones: tests/upstream/test_fsdp2_no_sync_param_used_only_in_last_microbatch.py)."""
    from fsdp_verify.properties.model_draws import experts_cannot_accumulate

    strategy = cases(engine="fsdp2", world_sizes=(2, 4), hsdp=True, pp=[2], model_kinds=("mlp",), experts=[2, 3, 4])
    drawn = draw_cases(strategy, 40, 9105)
    assert all(c.pp == 2 and c.model.experts for c in drawn)
    assert not any(experts_cannot_accumulate(c.model, c.precision) for c in drawn)
    assert {c.precision.param_dtype for c in drawn} >= {None, "bf16"}


def test_tied_embeddings_across_the_first_and_last_stage_are_bit_exact(fsdp_check):
    case = pp_case(4, 2, "gpipe", replace(LM4, tie_embeddings=True), precision=BF16)
    verdict = fsdp_check(case)
    assert verdict.ok, verdict.summary()
    assert not _inexact(verdict)
    _tolerances_sane(verdict)


@pytest.mark.parametrize(
    ("world", "pp", "schedule", "model", "mesh", "precision"),
    [
        pytest.param(6, 3, "1f1b", MLP5, None, None, id="pp3-dp2-mlp"),
        pytest.param(2, 2, "interleaved1f1b", LM4, None, BF16, id="pp2-interleaved-lm-bf16"),
        pytest.param(4, 2, "gpipe", replace(LM4, tie_embeddings=True), (1, 2), None, id="pp2-hsdp-tied-lm"),
    ],
)
def test_a_clip_over_the_stages_is_bit_exact(fsdp_check, world, pp, schedule, model, mesh, precision):
    """Each pp rank's stages' norm squared, summed over the "pp" group, the root (torchtitan's
    clip under pp; verify/engines/pipeline_engine.py): the reference sums the same per-rank norms
    as gloo does (reference/pipeline_parallel.py, `stages_norm`), a tied embedding counted once."""
    case = pp_case(world, pp, schedule, model, mesh, precision, clip_norm=0.05)
    verdict = fsdp_check(case)
    assert verdict.ok, verdict.summary()
    assert not _inexact(verdict)
    assert any(f.phase == "grad_norm" for f in verdict.findings)  # the norm was recorded and judged


def test_a_clip_by_the_own_stages_norm_is_caught_at_the_norm(fsdp_check):
    case = pp_case(4, 2, m=2, clip_norm=0.05, engine="fsdp_verify.zoo.mutants:pp_clip_norm_of_own_stages")
    verdict = fsdp_check(case)
    first = verdict.first_divergence
    assert not verdict.ok and (first.step, first.phase) == (1, "grad_norm"), verdict.summary()


def test_a_stage_root_casts_the_residual_stream_as_fsdp2_does(fsdp_check):
    """A unit's fp32 output makes the residual stream fp32; where a stage begins FSDP2 casts it
    back to bf16 (the stage is a root): the reference runs its stages as roots too (a fresh-seed
    sweep's false alarm before, 7 of 100)."""
    wrap = ("layers.1.feed_forward", "layers.3", "")
    precision = PrecisionSpec(param_dtype="bf16", reduce_dtype="bf16", output_dtype="fp32")
    verdict = fsdp_check(pp_case(4, 2, "gpipe", LM4, precision=precision, m=3, wrap=wrap), calibrate=False)
    assert verdict.ok, verdict.summary()
    assert not _inexact(verdict)


def test_a_users_split_of_their_own_model(fsdp_check):
    model = ModelSpec(kind="custom", factory="tests/user/models.py:user_lm", kwargs={"n_layers": 4})
    case = pp_case(4, 2, "1f1b", model, m=2, pp_split="tests/user/pp_splits.py:user_lm_stages")
    verdict = fsdp_check(case)
    assert verdict.ok, verdict.summary()
    assert not _inexact(verdict)


# ---- FSDP2's knobs inside a stage (issue 50, item 4) ------------------------------------------------
# Each stage is sharded by the engine with the case's knobs: offload, Shard(1) placements, a sum
# reduction (the schedule's loss divided by the data-parallel size too), explicit prefetching
# among the stage's own units, unfreezing mid-run (each rank its stages' parameters, a tied
# embedding's last-stage copy with the first's).
KNOBS = [
    pytest.param({"offload": True}, MLP5, None, id="offload"),
    pytest.param({"shard_placement": "dim1"}, MLP5, BF16, id="shard1-bf16"),
    pytest.param({"shard_placement": "mixed", "grad_reduction": "sum"}, LM4, None, id="mixed-sum-lm"),
    pytest.param({"grad_reduction": "sum"}, MLP5, BF16, id="sum-mlp-bf16"),
    pytest.param({"prefetch": 1}, LM4, BF16, id="prefetch-lm-bf16"),
]
UNFROZEN = replace(LM4, tie_embeddings=True, frozen=("tok_embeddings.weight", "layers.3"))


@pytest.mark.parametrize(("knobs", "model", "precision"), KNOBS)
def test_fsdp2_knobs_inside_a_stage_are_bit_exact(fsdp_check, knobs, model, precision):
    verdict = fsdp_check(pp_case(4, 2, "gpipe", model, precision=precision, m=2, **knobs))
    assert verdict.ok, verdict.summary()
    assert not _inexact(verdict)


def test_unfreezing_a_tied_embedding_across_the_stages_is_bit_exact(fsdp_check):
    """The tied embedding is frozen under its first name only; its last stage's copy unfreezes
    with it (else the two ranks' `sync_tied` all-reduces differ: a hang, found by a sweep)."""
    case = pp_case(4, 2, "gpipe", UNFROZEN, precision=BF16, m=2, steps=3, unfreeze_step=2)
    verdict = fsdp_check(case)
    assert verdict.ok, verdict.summary()
    assert not _inexact(verdict)


@pytest.mark.parametrize(
    ("mutant", "knobs", "phase"),
    [
        ("offload_grad_added_twice", {"offload": True}, "grads"),
        ("shard1_cut_on_dim0", {"shard_placement": "dim1"}, "init"),
        ("sum_reduction_loss_not_divided", {"grad_reduction": "sum"}, "grads"),
        ("sum_reduction_factor_left_at_avg", {"grad_reduction": "sum"}, "build"),  # the knobs check
    ],
)
def test_knob_mutants_inside_a_stage_are_caught(fsdp_check, mutant, knobs, phase):
    case = pp_case(4, 2, "gpipe", m=2, engine=f"fsdp_verify.zoo.mutants:{mutant}", **knobs)
    verdict = fsdp_check(case)
    assert not verdict.ok and verdict.first_divergence.phase == phase, verdict.summary()


def test_an_unfreeze_that_misses_the_stages_parameters_is_caught(fsdp_check):
    engine = "fsdp_verify.zoo.mutants:unfreeze_misses_sharded_params"
    case = pp_case(4, 2, "gpipe", UNFROZEN, m=2, steps=3, unfreeze_step=2, engine=engine)
    verdict = fsdp_check(case)
    first = verdict.first_divergence
    assert not verdict.ok and (first.step, first.phase) == (2, "grads"), verdict.summary()


# ---- compiled stages (issue 50, item 4) ---------------------------------------------------------------
# Each stage's units are compiled in place before `fully_shard`, as without stages; the reference
# compiles the same modules, so the graphs match bit for bit. A stage compiled whole (`compile:
# model`) is refused (verify/dims/together.py says why).
@pytest.mark.parametrize(
    ("scope", "model", "precision"),
    [
        pytest.param("units", MLP5, None, id="units-mlp"),
        pytest.param("units", LM4, BF16, id="units-lm-bf16", marks=pytest.mark.slow),
        pytest.param("blocks", LM4, None, id="blocks-lm"),  # torchtitan's per-block compile, in stages
    ],
)
def test_compiled_stages_agree_with_the_compiled_reference(fsdp_check, scope, model, precision):
    case = pp_case(4, 2, "gpipe", model, precision=precision, m=2, compile=scope, compile_backend="aot_eager")
    verdict = fsdp_check(case)
    assert verdict.ok, verdict.summary()
    assert not _inexact(verdict)
    said = {f.phase: f for f in verdict.findings if f.phase in ("compile", "compiler")}
    assert "no frame compiled every step" in said["compile"].message, said["compile"].message


@pytest.mark.parametrize(
    ("mutant", "phase"),
    [
        ("unit_compiled_with_unsharded_params", "grads"),
        pytest.param("recompiles_every_step", "compile", marks=pytest.mark.slow),
    ],
)
def test_compile_mutants_inside_a_stage_are_caught(fsdp_check, mutant, phase):
    engine = f"fsdp_verify.zoo.mutants:{mutant}"
    case = pp_case(4, 2, "gpipe", m=2, steps=3, compile="units", compile_backend="aot_eager", engine=engine)
    verdict = fsdp_check(case)
    assert not verdict.ok and verdict.first_divergence.phase == phase, verdict.summary()


# ---- tp x pp: torchtitan's 3-D (issue 50, item 4) -----------------------------------------------------
# The tp plan goes on the whole model before the split (a style is its module's: each stage keeps
# its own), each stage is sharded over the data-parallel dims; the reference chains the two
# emulations: each tp rank's local gradients reduced stage by stage, the clip's norm a stage's
# 2-D norm per pp rank, summed over the stages.
LM4_TP = replace(LM4, vocab_size=32, ffn_hidden=24)
TP_PP = [
    pytest.param(4, None, {"clip_norm": 0.05}, id="pp2-tp2-fp32-clip"),
    # the schedule's loss on the last stage over vocabulary shards, forward and backward (torchtitan's)
    pytest.param(4, BF16, {"loss_parallel": True, "sequence_parallel": True}, id="pp2-tp2-bf16-sp-loss-parallel"),
    pytest.param(
        8, BF16, {"clip_norm": 0.05, "sequence_parallel": True}, id="pp2-dp2-tp2-bf16-sp-clip", marks=pytest.mark.slow
    ),
]


@pytest.mark.parametrize(("world", "precision", "knobs"), TP_PP)
def test_tp_beside_pp_is_bit_exact(fsdp_check, world, precision, knobs):
    case = pp_case(world, 2, "gpipe", LM4_TP, precision=precision, m=2, tp=2, **knobs)
    verdict = fsdp_check(case)
    assert verdict.ok, verdict.summary()
    assert not _inexact(verdict)


@pytest.mark.parametrize(
    ("mutant", "world", "knobs", "phase"),
    [
        pytest.param("dp_and_tp_dims_swapped", 8, {}, "logits", marks=pytest.mark.slow),  # the zoo's at 4 ranks
        ("tp_plan_on_first_stage_only", 4, {}, "build"),
        ("rowwise_output_not_all_reduced", 4, {}, "logits"),
        ("pp_clip_norm_of_own_stages", 4, {"clip_norm": 0.05}, "grad_norm"),
        ("rowwise_output_not_all_reduced", 4, {"loss_parallel": True}, "logits"),
    ],
)
def test_tp_beside_pp_mutants_are_caught(fsdp_check, mutant, world, knobs, phase):
    engine = f"fsdp_verify.zoo.mutants:{mutant}"
    case = pp_case(world, 2, "gpipe", LM4_TP, m=2, tp=2, engine=engine, **knobs)
    verdict = fsdp_check(case)
    assert not verdict.ok and verdict.first_divergence.phase == phase, verdict.summary()


def test_tp_and_pp_are_drawn_together():
    drawn = draw_cases(cases(engine="fsdp2", world_sizes=(4, 8), hsdp=True, pp=[2], tp=[2]), 30, 7)
    assert all(c.pp == 2 and c.tp == 2 for c in drawn)
    assert {c.dp_size for c in drawn} == {1, 2}
    for case in drawn:
        refuse_untakeable(case)


def test_contracts_are_not_applicable_under_pp_with_the_reason():
    held = case_contracts(pp_case(4, 2))
    assert not held.comm and not held.memory and "point-to-point" in held.why


# ---- mutants -------------------------------------------------------------------------------------------
MUTANTS = [
    "pp_loss_not_divided_by_microbatches",
    "pp_stage_boundary_detached",
    "pp_stage_reduces_every_microbatch",
    "pp_microbatches_reversed_on_last_stage",
]


@pytest.mark.parametrize("mutant", MUTANTS)
def test_each_pipeline_mutant_is_caught(fsdp_check, mutant):
    verdict = fsdp_check(pp_case(4, 2, m=2).with_(engine=f"fsdp_verify.zoo.mutants:{mutant}"))
    assert not verdict.ok
    assert verdict.first_divergence.phase == "grads", verdict.summary()


def test_a_schedule_that_does_not_scale_the_gradients_is_bit_exact_and_one_that_does_is_caught(fsdp_check):
    """`pp_scale_grads: false` (torchtitan's schedule): each micro-batch's loss its share of the
    step's, nothing divided after; the built-in engine's schedule takes it bit for bit, and a
    schedule that divides anyway is M times too small."""
    case = pp_case(4, 2, "gpipe", LM4, m=2, pp_scale_grads=False, clip_norm=0.5)
    verdict = fsdp_check(case)
    assert verdict.ok and not _inexact(verdict), verdict.summary()
    verdict = fsdp_check(case.with_(engine="fsdp_verify.zoo.mutants:pp_loss_not_divided_by_microbatches"))
    assert not verdict.ok and verdict.first_divergence.phase == "grads", verdict.summary()


def test_tied_gradients_not_summed_between_the_stages_are_caught(fsdp_check):
    model = replace(LM4, tie_embeddings=True)
    case = pp_case(4, 2, "gpipe", model, m=2, engine="fsdp_verify.zoo.mutants:pp_tied_embedding_grads_not_summed")
    verdict = fsdp_check(case)
    first = verdict.first_divergence
    assert not verdict.ok and (first.phase, first.name) == ("grads", "tok_embeddings.weight"), verdict.summary()


# ---- opt-in, drawn, bad input ------------------------------------------------------------------------
def test_a_plugin_that_declares_nothing_refuses_pp_naming_the_declaration(capsys):
    """In process (the CLI's exit code end to end: docs/pipeline-parallel.md's console block)."""
    args = ["check", "--engine", EVERYTHING, "--model", "mlp", "--pp", "2", "--world-size", "4"]
    assert main([*args, "--microbatches", "2", "--sync-last"]) == 2
    err = capsys.readouterr().err
    assert "pp: expected 1" in err and "Capabilities(takes=('pp', ...))" in err and "Traceback" not in err, err


@settings(max_examples=100, database=None, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=cases(engine=EVERYTHING, world_sizes=(2, 4), hsdp=True))
def test_pp_is_never_drawn_for_an_engine_that_does_not_declare_it(case):
    assert case.pp == 1
    refuse_untakeable(case)


def test_pipelines_and_grouped_experts_are_drawn_only_where_asked():
    """Unasked, neither draws anything: a seed draws the cases it drew before they existed (the
    property tests' pinned seeds and the reports' counts stay what they were)."""
    drawn = draw_cases(cases(engine="fsdp2", world_sizes=(2, 4), hsdp=True, experts=[2, 4]), 60, 3)
    assert drawn and all(c.pp == 1 and c.ep == 1 and c.model.top_k is None for c in drawn)
    asked = draw_cases(cases(engine="fsdp2", world_sizes=(4,), pp=[1, 2], model_kinds=("mlp",)), 40, 3)
    assert any(c.pp == 2 for c in asked)


def test_fsdp2_is_drawn_pipelines_of_every_schedule_with_fsdp_and_hsdp():
    strategy = cases(
        engine="fsdp2", world_sizes=(2, 4), hsdp=True, pp=[2, 4], n_layers=[4], widths=[(8, 9, 10, 11, 12)]
    )
    drawn = draw_cases(strategy, 80, 41)
    seen = Counter((c.pp, c.pp_schedule, len(c.mesh)) for c in drawn)
    assert {s for _, s, _ in seen} == {"gpipe", "1f1b", "interleaved1f1b"}, seen
    assert {p for p, _, _ in seen} == {2, 4} and {m for _, _, m in seen} == {1, 2}, seen
    for case in drawn:
        refuse_untakeable(case)


@pytest.mark.parametrize(
    ("changes", "field", "words"),
    [
        ({"pp": 3}, "world_size", "a multiple of pp=3"),
        ({"pp_schedule": "zero_bubble"}, "pp_schedule", "one of"),
        ({"microbatches": 1, "data": DataSpec(batch_size=4)}, "microbatches", "at least pp=2 under 1F1B"),
        ({"sync_every_microbatch": True}, "sync_every_microbatch", "reduces once after the last"),
        (
            {"loss_scaling": LossScaleSpec(), "precision": PrecisionSpec(param_dtype="fp16")},
            "loss_scaling",
            "not modelled",
        ),
        ({"model": ModelSpec(kind="mlp", widths=(4, 4))}, "pp", "as many stages"),
        ({"model": ModelSpec(kind="mlp", widths=(4, 4, 4), dropout=0.1)}, "model.dropout", "own masks"),
        (
            {"model": ModelSpec(kind="mlp", widths=(4, 4, 4), experts=2, top_k=1)},
            "model.top_k",
            "grouped experts (their routing counts are all-reduced over every rank",
        ),
        ({"pp": 1}, "pp_schedule", "with pp=1"),
        ({"pp": 1, "pp_schedule": "1f1b", "pp_scale_grads": False}, "pp_scale_grads", "with pp=1"),
        ({"pp_scale_grads": "no"}, "pp_scale_grads", "true or false"),
        ({"compile": "model"}, "compile", "None or 'units' or 'blocks' with pp=2"),
        (
            {"model": ModelSpec(kind="mlp", widths=(4, 4, 4), frozen=("layers.0",)), "unfreeze_step": 2, "steps": 2},
            "unfreeze_step",
            "first stage is frozen whole",
        ),
    ],
)
def test_bad_pipeline_input_names_the_field(changes, field, words):
    base = {
        "model": ModelSpec(kind="mlp", widths=(4, 4, 4)),
        "world_size": 4,
        "pp": 2,
        "pp_schedule": "gpipe" if changes.get("pp") == 1 else "1f1b",
        "microbatches": 2,
        "sync_every_microbatch": False,
        "data": DataSpec(batch_size=8),
    }
    with pytest.raises(CaseError) as e:
        Case(**{**base, **changes})
    assert e.value.field_path == field and words in str(e.value), str(e.value)


def test_a_split_that_copies_the_modules_is_refused_before_any_rank_starts():
    model = ModelSpec(kind="custom", factory="tests/user/models.py:user_lm")
    with pytest.raises(CaseError, match="pp_split.*is not a parameter of the model"):
        pp_case(2, 2, "1f1b", model, m=2, pp_split="tests/user/pp_splits.py:copies_the_blocks")


def test_a_case_file_naming_a_split_is_refused_unless_trusted(tmp_path, monkeypatch, capsys):
    """Read from a folder no pyproject.toml allow-lists (this repository's trusts tests/user/*.py),
    the split is named among the refused code, and nothing runs."""
    model = ModelSpec(kind="custom", factory="tests/user/models.py:user_lm")
    case = pp_case(2, 2, "gpipe", model, m=2, pp_split="tests/user/pp_splits.py:user_lm_stages")
    path = tmp_path / "case.json"
    path.write_text(case.to_json())
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("FSDP_VERIFY_TRUST_CODE", raising=False)
    assert main(["check", "--case", str(path)]) == 2
    err = capsys.readouterr().err
    assert "pp_split: 'tests/user/pp_splits.py:user_lm_stages'" in err and "--trust-code" in err, err
