"""Issue 40, a checkpoint and resume across a change of ep or pp degree (docs/resume.md): DCP
reshards the experts over the resumed ep dim and a pipeline's stages (whose keys are the unsplit
model's) into the resumed split; the reference, the run never stopped, goes on with the resumed
case's ep and pp arithmetic. Correct resumes are bit-exact; a load into another ep rank's slots or
another stage is caught right after it; a plain plug-in is never drawn a degree; bad input names
its field."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from fsdp_verify.case import Case
from fsdp_verify.case_specs import DataSpec, PrecisionSpec
from fsdp_verify.commands.cli import main
from fsdp_verify.models import ModelSpec
from fsdp_verify.properties.draw import draw_cases
from fsdp_verify.properties.strategies import cases
from fsdp_verify.reference.trainer import train_reference
from fsdp_verify.runner import refuse_untakeable
from fsdp_verify.validation import CaseError

EVERYTHING = "examples/engine/my_engine.py:shard_everything"
BF16 = PrecisionSpec(param_dtype="bf16", reduce_dtype="fp32")
MOE = ModelSpec(kind="mlp", widths=(16, 33, 17, 8), experts=4, top_k=2)
MLP5 = ModelSpec(kind="mlp", widths=(16, 33, 17, 9, 8))  # four blocks: up to four stages
LM4 = ModelSpec(kind="transformer", vocab_size=31, dim=16, n_layers=4, n_heads=2, ffn_hidden=23, seq_len=6)
TIED = replace(LM4, tie_embeddings=True)
LM4_TP = replace(LM4, vocab_size=32, ffn_hidden=24)  # splits over tp 2
EVEN = ModelSpec(kind="mlp", widths=(8, 8, 8, 8, 8))  # every block of one shape: another stage's loads


def moe_resume(world: int, ep: int, to_world: int, to_ep: int, mesh=None, to_mesh=None, **changes) -> Case:
    return Case(
        model=changes.pop("model", MOE),
        world_size=world,
        mesh_shape=mesh,
        ep=ep,
        data=DataSpec(batch_size=12 * changes.get("microbatches", 1)),
        steps=3,
        resume_after=1,
        resume_world_size=to_world,
        resume_mesh_shape=to_mesh,
        resume_ep=to_ep,
        **changes,
    )


def pp_resume(world: int, pp: int, to_world: int, to_pp: int | None, model=MLP5, **changes) -> Case:
    return Case(
        model=model,
        world_size=world,
        pp=pp,
        pp_schedule=changes.pop("pp_schedule", "1f1b"),
        microbatches=4,
        sync_every_microbatch=False,
        data=DataSpec(batch_size=16),
        steps=3,
        resume_after=1,
        resume_world_size=to_world,
        resume_pp=to_pp,
        **changes,
    )


def _passes_exactly(verdict, case: Case) -> None:
    assert verdict.ok, verdict.table()
    loaded = [f for f in verdict.findings if f.phase == "resumed"]
    assert loaded and all(f.ok for f in loaded)
    assert max(f.step for f in verdict.findings) == case.steps  # every step after the resume compared
    inexact = [(f.key, f.max_abs) for f in verdict.findings if f.phase != "param_sums" and f.max_abs not in (0, None)]
    assert not inexact, inexact  # bit-exact, as without a resume (docs/expert-parallel.md, pipeline-parallel.md)


# ---- correct resumes: bit-exact (the nightly's matrix behind `slow`) -----------------------------------
SLOW = pytest.mark.slow
RESUMES = [
    pytest.param(moe_resume(2, 2, 4, 4), id="ep2-w2-to-ep4-w4"),
    pytest.param(
        moe_resume(
            4, 4, 2, 1, precision=BF16, model=replace(MOE, capacity_factor=1.0, aux_loss=0.01, router_bias=0.01)
        ),
        id="ep4-w4-to-ep1-w2-bf16-capacity-aux-bias",
    ),
    pytest.param(pp_resume(4, 2, 2, None), id="pp2-dp2-to-pp2-dp1"),
    # The same layout again: each rank of a later stage resumes its data-parallel rank's stream
    # (before, rank r's own seed was expected there while the loop seeds by data-parallel rank).
    pytest.param(pp_resume(4, 2, 4, None), id="pp2-dp2-same-layout"),
    pytest.param(pp_resume(4, 2, 4, 1), id="pp2-dp2-to-four-data-parallel-ranks"),
    pytest.param(pp_resume(4, 2, 4, 2, tp=2, model=LM4_TP), id="tp2-pp2-to-tp2-pp2", marks=SLOW),
    pytest.param(pp_resume(4, 2, 4, 1, tp=2, model=LM4_TP), id="tp2-pp2-to-tp2-dp2", marks=SLOW),
    pytest.param(pp_resume(2, 2, 1, 1, model=TIED), id="pp2-tied-lm-to-one-device"),
    pytest.param(moe_resume(2, 2, 1, 1), id="ep2-w2-to-one-device", marks=SLOW),
    pytest.param(moe_resume(4, 2, 4, 4, mesh=(2, 2)), id="ep2-hsdp22-to-ep4-w4", marks=SLOW),
    pytest.param(moe_resume(4, 4, 4, 2, to_mesh=(2, 2), precision=BF16), id="ep4-w4-to-ep2-hsdp22-bf16", marks=SLOW),
    pytest.param(moe_resume(2, 1, 4, 2, microbatches=2), id="ep1-w2-to-ep2-w4-microbatches", marks=SLOW),
    pytest.param(
        moe_resume(4, 2, 2, 2, model=replace(MOE, top_k=1, router_bias=0.05)),
        id="ep2-w4-to-ep2-w2-top1-bias",
        marks=SLOW,
    ),
    pytest.param(pp_resume(2, 2, 4, 4), id="pp2-to-pp4", marks=SLOW),
    pytest.param(pp_resume(4, 4, 4, 2, pp_schedule="gpipe"), id="pp4-to-pp2-dp2-gpipe", marks=SLOW),
    pytest.param(
        pp_resume(4, 2, 2, 2, model=LM4, pp_schedule="interleaved1f1b", precision=BF16),
        id="pp2-interleaved-lm-bf16-dp2-to-dp1",
        marks=SLOW,
    ),
    pytest.param(pp_resume(2, 2, 4, 4, model=TIED), id="pp2-to-pp4-tied-lm", marks=SLOW),
    pytest.param(pp_resume(4, 2, 2, 1, mesh_shape=(1, 2)), id="pp2-hsdp12-to-two-ranks", marks=SLOW),
    pytest.param(pp_resume(2, 1, 4, 2), id="no-stages-to-pp2-dp2", marks=SLOW),
]


@pytest.mark.parametrize("case", RESUMES)
def test_a_resume_across_an_ep_or_pp_change_is_bit_exact(fsdp_check, case):
    _passes_exactly(fsdp_check(case), case)


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(moe_resume(4, 2, None, None, model=replace(MOE, router_bias=0.05)), id="ep2"),
        pytest.param(pp_resume(4, 2, None, None), id="pp2"),
    ],
)
def test_the_reference_through_a_resume_with_ep_or_pp_is_the_run_never_stopped(case):
    """The same world size and degrees: the resumed reference gives the records of the run
    without a resume bit for bit (the hand-over, the ep and pipeline arithmetic, every rank's
    generator: a pipeline's later stages hold theirs too)."""
    plain, resumed = train_reference(case.with_(resume_after=None)), train_reference(case)
    records = {k: v for k, v in resumed.records.items() if k[1] != "resumed"}
    assert records.keys() == plain.records.keys()
    for k, v in records.items():
        torch.testing.assert_close(v, plain.records[k], rtol=0, atol=0, msg=str(k))
    assert len(resumed.records[(1, "resumed", "rng")]) == case.world_size  # every rank's, stages too


# ---- mutants: caught right after the load ----------------------------------------------------------------
@pytest.mark.parametrize(
    ("mutant", "case", "where", "hint"),
    [
        (
            "ep_experts_loaded_into_another_ep_rank",
            moe_resume(2, 2, 4, 4),
            "moe.experts.",
            "moved round by 1 (chunk i holds the saved chunk i + 1)",
        ),
        (
            "ep_experts_loaded_into_another_ep_rank",
            moe_resume(4, 4, 2, 2),
            "moe.experts.",
            "moved round by 1 (chunk i holds the saved chunk i + 1)",
        ),
        (
            "pp_stage_loads_another_stages_state",
            pp_resume(4, 2, 2, None, model=EVEN),
            "params.layers.2.",
            "saved layers.0",
        ),
        ("pp_stage_loads_another_stages_state", pp_resume(2, 2, 4, 4, model=LM4), "params.layers.3.", "saved layers.0"),
    ],
)
def test_a_load_into_another_ranks_slots_is_caught_at_the_load(fsdp_check, mutant, case, where, hint):
    verdict = fsdp_check(case.with_(engine=f"fsdp_verify.zoo.mutants:{mutant}"), calibrate=False)
    first = verdict.first_divergence
    assert not verdict.ok and (first.step, first.phase) == (1, "resumed"), verdict.summary()
    assert where in first.name and hint in verdict.summary(), verdict.summary()


@pytest.mark.parametrize(
    ("mutant", "case"),
    [
        pytest.param("ep_experts_loaded_into_another_ep_rank", moe_resume(2, 2, 2, 1), id="ep-resumed-on-ep1"),
        pytest.param("pp_stage_loads_another_stages_state", pp_resume(2, 2, 1, 1), id="pp-resumed-without-stages"),
    ],
)
def test_the_mutants_are_mutations_of_what_they_name(fsdp_check, mutant, case):
    """Resumed without ep every rank holds every expert, without stages no stage loads another's:
    the same mutants load correctly."""
    verdict = fsdp_check(case.with_(engine=f"fsdp_verify.zoo.mutants:{mutant}"), calibrate=False)
    assert verdict.ok, verdict.summary()


# ---- drawn where asked, never for a plug-in that declares nothing ----------------------------------------
@settings(max_examples=40, database=None, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=cases(engine=EVERYTHING, resume=True, model_kinds=("mlp",), experts=4))
def test_a_plain_plugin_is_never_drawn_a_resumed_degree(case):
    after = case.after_resume()
    assert case.resume_ep is None and case.resume_pp is None and (after.ep, after.pp) == (1, 1)
    refuse_untakeable(after)


def test_fsdp2_resumes_are_drawn_across_ep_and_pp_changes():
    ep = draw_cases(cases(world_sizes=(1, 2, 4), resume=True, model_kinds=("mlp",), experts=4, ep=[2, 4]), 60, 7)
    changes = Counter((c.ep, c.after_resume().ep) for c in ep)
    assert {(2, 1), (2, 4)} <= set(changes) and any(a == 4 != b for a, b in changes), changes
    pp = draw_cases(cases(world_sizes=(2, 4), resume=True, pp=2), 40, 7)
    changes = Counter((c.pp, c.after_resume().pp) for c in pp)
    assert {(2, 1), (2, 2)} <= set(changes), changes
    for case in ep + pp:
        refuse_untakeable(case.before_resume())
        refuse_untakeable(case.after_resume())


# ---- bad input -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("case", "field", "words"),
    [
        (lambda: moe_resume(2, 2, 2, 0), "resume_ep", "null or a positive integer"),
        (lambda: moe_resume(2, 2, 2, 4), "resume_ep", "a divisor of the shard dimension 2"),
        (lambda: moe_resume(2, 2, 2, 3), "resume_ep", "a divisor of the experts (4)"),
        (lambda: moe_resume(2, 2, None, 2).with_(resume_after=None), "resume_ep", "null without resume_after"),
        (lambda: pp_resume(4, 2, 4, 3), "resume_world_size", "a multiple of pp=3"),
        (lambda: pp_resume(2, 1, 2, 2, model=TIED), "resume_pp", "has no key to load"),
    ],
)
def test_a_bad_resumed_degree_names_its_field(case, field, words):
    with pytest.raises(CaseError) as e:
        case()
    assert e.value.field_path == field and words in str(e.value), str(e.value)


def test_check_refuses_a_bad_resumed_degree_with_exit_code_2(capsys):
    args = ["check", "--model", "mlp", "--experts", "4", "--top-k", "2", "--ep", "2", "--world-size", "2"]
    assert main([*args, "--steps", "3", "--resume-after", "1", "--resume-ep", "4"]) == 2
    err = capsys.readouterr().err
    assert "resume_ep" in err and "for the resumed run" in err and "Traceback" not in err, err
