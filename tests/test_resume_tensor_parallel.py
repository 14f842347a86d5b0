"""A resume beside tensor parallelism (docs/resume.md, docs/tensor-parallel.md): FSDP2 + tp saved
with torch.distributed.checkpoint under one (dp, tp) mesh and loaded under another, the tp degree
changing (`resume_tp`): DCP reshards the 2-D DTensors, the reference's resumed run computes on the
new degree. The field's validation, the draw (only where tp is asked; never for a plug-in that
declares nothing), correct runs bit-exact, and the zoo's two loads that break it caught."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from fsdp_verify.case import Case, CaseError
from fsdp_verify.case_specs import DataSpec, PrecisionSpec
from fsdp_verify.commands.case_flags import case_to_flags
from fsdp_verify.commands.cli import build_parser, main
from fsdp_verify.commands.options import case_from_args
from fsdp_verify.engines import refuse_untakeable
from fsdp_verify.properties.pins import PinError
from fsdp_verify.properties.strategies import cases
from fsdp_verify.reference import train_reference
from tests.test_tensor_parallel import PLAIN, TINY, exact, find, llama

MUTANTS = "fsdp_verify.zoo.mutants:"
DROPOUT = TINY.__class__(**{**TINY.__dict__, "dropout": 0.1})
HEADS4 = TINY.__class__(**{**TINY.__dict__, "n_heads": 4, "dim": 32, "dropout": 0.1})  # splits over tp 4


def resumed(world: int = 2, tp: int = 2, **changes) -> Case:
    """A tiny Transformer on `world` ranks at tp `tp`, saved after step 1 of 3."""
    base = {"model": TINY, "world_size": world, "tp": tp, "steps": 3, "resume_after": 1}
    return Case(**{**base, "data": DataSpec(batch_size=4), **changes})


# ---- the case --------------------------------------------------------------------------------------
def test_the_resumed_run_takes_the_new_degree_and_keeps_the_world():
    case = resumed(4, 2, mesh_shape=(2,), sequence_parallel=True, loss_parallel=True, resume_tp=1)
    after = case.after_resume()
    assert (after.world_size, after.tp, after.mesh, after.dp_size) == (4, 1, (4,), 4)
    assert not after.sequence_parallel and not after.loss_parallel  # tp 1: no plan, none of its styles
    up = resumed(4, 2, sequence_parallel=True, resume_tp=4, model=HEADS4)
    assert (up.after_resume().tp, up.after_resume().dp_size, up.after_resume().sequence_parallel) == (4, 1, True)
    hsdp = resumed(8, 2, mesh_shape=(2, 2), resume_tp=4, resume_mesh_shape=(1, 2), model=HEADS4)
    assert hsdp.after_resume().device_mesh_shape == (1, 2, 4)
    assert "resume_tp" not in resumed().to_dict()  # absent when unset: a case's hash stays
    again = Case.from_json(hsdp.to_json())
    assert again == hsdp and again.hash == hsdp.hash
    for case in (hsdp, resumed(sequence_parallel=True, resume_tp=1)):  # one spelling: `check --resume-tp`
        flags = case_to_flags(case)
        assert "--resume-tp" in flags and case_from_args(build_parser().parse_args(["check", *flags])) == case


@pytest.mark.parametrize(
    "changes, field, expected",
    [
        ({"resume_after": None, "resume_tp": 1}, "resume_tp", "null without resume_after"),
        ({"resume_tp": 0}, "resume_tp", "a positive integer"),
        ({"world_size": 4, "resume_tp": 3}, "resume_tp", "a divisor of the resumed world size 4"),
        ({"resume_tp": 4, "resume_world_size": 4}, "model.n_heads", "(for the resumed run)"),  # 2 heads
        ({"resume_tp": 1, "resume_world_size": 2, "data": DataSpec(batch_size=3)}, "data.batch_size", "resumed"),
        ({"resume_tp": 2, "resume_mesh_shape": (2, 2), "resume_world_size": 4}, "resume_mesh_shape", "resumed"),
    ],
)
def test_a_bad_resumed_degree_names_its_field(changes, field, expected):
    with pytest.raises(CaseError, match=expected.replace("(", r"\(").replace(")", r"\)")) as info:
        resumed(**changes)
    assert info.value.field_path == field


def test_a_plugin_that_declares_nothing_resumed_at_tp_2_exits_2_naming_resume_tp(capsys):
    flags = ["--engine", PLAIN, "--steps", "2", "--resume-after", "1", "--resume-tp", "2", "--vocab-size", "64"]
    assert main(["check", *flags]) == 2
    err = capsys.readouterr().err
    assert "resume_tp: expected 1" in err and "for the resumed run" in err, err


# ---- the draw ---------------------------------------------------------------------------------------
@settings(max_examples=40, database=None, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=cases(world_sizes=(2, 4), tp=[1, 2, 4], hsdp=True, precisions=("fp32", "bf16"), resume=True))
def test_every_drawn_resume_beside_tp_is_one_check_takes(case):
    refuse_untakeable(case.before_resume())
    refuse_untakeable(case.after_resume())
    assert case.after_resume().tp in (1, 2, 4)


def test_the_degree_changes_across_a_drawn_resume_only_where_tp_is_asked():
    asked = cases(world_sizes=(2, 4), tp=[1, 2], resume=True, precisions=("fp32",))
    assert find(asked, lambda c: c.tp == 2 and c.after_resume().tp == 1).resume_tp == 1
    assert find(asked, lambda c: c.tp == 1 and c.after_resume().tp == 2).resume_tp == 2
    plain = find(cases(world_sizes=(2, 4), resume=True), lambda c: True)
    assert plain.resume_tp is None and plain.after_resume().tp == 1


def test_a_plain_plugin_is_never_drawn_a_resume_beside_tp():
    with pytest.raises(PinError, match=r"tp: expected 1: engine .* does not declare `tp`"):
        cases(engine=PLAIN, tp=[1, 2], resume=True)
    drawn = find(cases(engine=PLAIN, resume=True), lambda c: True)
    assert (drawn.tp, drawn.after_resume().tp) == (1, 1)


# ---- the reference ------------------------------------------------------------------------------------
def test_the_reference_through_a_resume_at_the_same_degree_is_the_run_never_stopped():
    case = resumed(4, 2, sequence_parallel=True, model=DROPOUT)
    plain, through = train_reference(case.with_(resume_after=None)), train_reference(case)
    records = {k: v for k, v in through.records.items() if k[1] != "resumed"}
    assert records.keys() == plain.records.keys()
    for k, v in records.items():
        torch.testing.assert_close(v, plain.records[k], rtol=0, atol=0, msg=str(k))
    rng = through.records[(1, "resumed", "rng")].tolist()
    assert len(rng) == 4 and rng[0] == rng[1] != rng[2] == rng[3]  # one stream a data-parallel rank


# ---- correct runs: bit-exact; the loads that break it caught ------------------------------------------
# tp 2 -> 1 on two ranks (one data-parallel rank, then two) with sequence and loss parallelism and
# dropout: the 2-D shards resharded to 1-D, the styles gone, data-parallel rank 1 a fresh stream.
DOWN = resumed(2, 2, sequence_parallel=True, loss_parallel=True, model=DROPOUT, resume_tp=1)
# tp 1 -> 2 (two data-parallel ranks, then one tp group): rank 1 takes data-parallel rank 0's stream.
UP = resumed(2, 1, model=DROPOUT, resume_tp=2)


@pytest.mark.parametrize("case", [DOWN, UP], ids=["tp2-to-1-sp-lp-dropout", "tp1-to-2-dropout"])
def test_a_correct_resume_across_a_tp_change_is_bit_exact(fsdp_check, case):
    verdict = fsdp_check(case, calibrate=False)
    exact(verdict)
    assert [f for f in verdict.findings if f.phase == "resumed"]
    assert max(f.step for f in verdict.findings) == case.steps


@pytest.mark.parametrize(
    "mutant, case, name, words",
    [
        ("tp_shards_on_the_wrong_rank_on_resume", UP, "params.", "2 chunks along dim 0 moved round by 1"),
        ("rng_by_global_rank_on_resume", UP, "rng", "restored onto the wrong ranks"),
        ("rng_by_global_rank_on_resume", DOWN, "rng", "restored onto the wrong ranks"),
    ],
    ids=["shards-moved-1to2", "rng-1to2", "rng-2to1"],
)
def test_a_load_that_breaks_the_tp_reshard_is_caught_at_the_load_and_named(fsdp_check, mutant, case, name, words):
    verdict = fsdp_check(case.with_(engine=MUTANTS + mutant), calibrate=False)
    first = verdict.first_divergence
    assert not verdict.ok and (first.step, first.phase) == (1, "resumed"), verdict.table()
    assert first.name.startswith(name) and words in verdict.hint, (first, verdict.hint)


@pytest.mark.slow
def test_a_global_rank_generator_is_right_while_the_degree_stays(fsdp_check):
    """The mutant's slip shows only across a change: at one degree a tp group's ranks hold one
    stream, so rank r's own is its data-parallel rank's (nothing to catch, nothing cried)."""
    same = resumed(4, 2, model=DROPOUT)
    verdict = fsdp_check(same.with_(engine=MUTANTS + "rng_by_global_rank_on_resume"), calibrate=False)
    assert verdict.ok, verdict.table()


# ---- the nightly's matrix --------------------------------------------------------------------------
BF16 = PrecisionSpec(param_dtype="bf16", reduce_dtype="bf16")


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [
        resumed(4, 2, mesh_shape=(2,), model=HEADS4, resume_tp=4),  # (2, 2) -> (1, 4)
        resumed(4, 2, model=HEADS4, sequence_parallel=True, loss_parallel=True, resume_tp=4, precision=BF16),
        resumed(4, 4, model=HEADS4, sequence_parallel=True, resume_tp=2, resume_mesh_shape=(1, 2)),  # -> HSDP
        resumed(
            4,
            2,
            mesh_shape=(1, 2),
            model=HEADS4,
            sequence_parallel=True,
            resume_tp=1,
            resume_world_size=2,
            clip_norm=0.01,
        ),
        resumed(8, 2, mesh_shape=(2, 2), model=HEADS4, resume_tp=4, data=DataSpec(batch_size=8)),  # 3-D -> (2, 4)
        resumed(2, 1, model=HEADS4, resume_tp=4, resume_world_size=4, precision=BF16, microbatches=2),
    ],
    ids=["2x2-to-1x4", "tp2-to-4-sp-lp-bf16", "tp4-to-hsdp-1x2x2-sp", "hsdp-to-2-clip", "3d-to-2x4", "dp2-to-tp4"],
)
def test_the_transformer_resumed_across_tp_changes(fsdp_check, case):
    exact(fsdp_check(case, calibrate=False))


@pytest.mark.slow
@pytest.mark.parametrize("tp, resume_tp", [(2, 1), (1, 2), (2, 4)])
def test_tiny_llama_with_its_own_plan_resumed_across_a_tp_change(fsdp_check, tp, resume_tp):
    kwargs = {"num_key_value_heads": 4, "num_attention_heads": 4, "vocab_size": 64}
    case = llama(kwargs, world_size=4, tp=tp, precision=BF16).with_(steps=3, resume_after=2, resume_tp=resume_tp)
    exact(fsdp_check(case, calibrate=False))
