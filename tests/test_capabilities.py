"""Issue 37: an engine is held only to what it declares (verify/engines/capabilities.py). A plain
plug-in is drawn the stable contract and the loop's settings, never an engine-side knob; a knob
it did not declare is bad input before any rank starts; a knob declared and not applied is named
as such (verify/engines/applied.py); a collective mismatch between ranks is named as one."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from fsdp_verify.case import ModelSpec
from fsdp_verify.engines.capabilities import ENGINE_KNOBS, KNOBS, LOOP_KNOBS, PARALLEL_KNOBS, TAKEABLE, Capabilities
from fsdp_verify.properties.pins import PinError
from fsdp_verify.properties.strategies import cases
from fsdp_verify.runner import refuse_untakeable
from fsdp_verify.sharded.pool import RankFailure
from fsdp_verify.validation import CaseError
from tests.conftest import mlp_case
from tests.found import find
from tests.in_process import run_cli

PLAIN = "examples/engine/my_engine.py:shard"
EVERYTHING = "examples/engine/my_engine.py:shard_everything"


# ---- the draw ----------------------------------------------------------------------------------------
@settings(max_examples=300, database=None, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=cases(engine=PLAIN, hsdp=True, precisions=("fp32", "bf16", "fp16")))
def test_a_plain_plugin_is_never_drawn_an_engine_side_knob(case):
    asked = [k.name for k in ENGINE_KNOBS.values() if k.asked(case)]
    assert not asked, f"{asked} drawn for an engine that declares none of them"
    refuse_untakeable(case)  # and what is drawn is what check takes


@pytest.mark.parametrize("knob", sorted(LOOP_KNOBS))
def test_a_plain_plugin_is_drawn_the_loops_settings(knob):
    assert KNOBS[knob].asked(find(cases(engine=PLAIN, hsdp=True), KNOBS[knob].asked))


@pytest.mark.parametrize("knob", sorted(ENGINE_KNOBS))
def test_an_engine_that_declares_every_knob_is_drawn_each(knob):
    # torch.compile is drawn at a profile's rate (0 under ci and dev: properties/profiles.py)
    strategy = cases(engine=EVERYTHING, hsdp=True, compile_rate=0.5)
    assert KNOBS[knob].asked(find(strategy, KNOBS[knob].asked))


def test_the_builtin_engines_declare_what_they_take():
    from fsdp_verify.engines import engine_capabilities

    assert engine_capabilities("fsdp2").takes == frozenset(TAKEABLE)
    assert set(PARALLEL_KNOBS) == {"ep", "pp", "tp", "sequence_parallel", "loss_parallel"}
    assert engine_capabilities("fsdp1").taken() == {"experts", "unfreeze_step"}
    assert engine_capabilities("flat").taken() == {"experts"}
    assert engine_capabilities(PLAIN).taken() == frozenset(LOOP_KNOBS)


def test_a_declaration_names_known_knobs_only():
    with pytest.raises(ValueError, match=r"takes must name some of .*'offlaod'"):
        Capabilities(takes=("offlaod",))
    with pytest.raises(ValueError, match=r"module_takes must name"):
        Capabilities(module_takes=("offload",))  # an engine-side knob is declared in `takes`
    assert Capabilities(takes="prefetch").takes == {"prefetch"}


# ---- bad input -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("field", "value"),
    [("offload", True), ("grad_reduction", "sum"), ("ignored", ("layers.0",)), ("prefetch", 1), ("compile", "units")],
)
def test_an_undeclared_knob_is_refused_naming_the_field_and_the_declaration(field, value):
    with pytest.raises(CaseError) as e:
        refuse_untakeable(mlp_case(2, engine=PLAIN, **{field: value}))
    assert e.value.field_path == field
    assert f"does not declare `{field}`" in str(e.value) and f"Capabilities(takes=('{field}', ...))" in str(e.value)
    refuse_untakeable(mlp_case(2, engine=EVERYTHING, **{field: value}))
    with pytest.raises(PinError, match=rf"^{field}: expected .* does not declare"):
        cases(engine=PLAIN, **{field: value})


def test_routed_experts_are_refused_for_a_plain_plugin():
    with pytest.raises(CaseError) as e:
        refuse_untakeable(mlp_case(2, engine=PLAIN).with_(model=ModelSpec(kind="mlp", experts=2)))
    assert e.value.field_path == "model.experts"


def test_check_with_an_undeclared_knob_exits_2_before_any_rank_starts():
    r = run_cli(["check", "--model", "mlp", "--engine", PLAIN, "--offload"])
    assert r.returncode == 2, r.stdout + r.stderr
    assert "offload: expected False" in r.stderr and "Capabilities(takes=('offload', ...))" in r.stderr
    assert "Traceback" not in r.stderr and "rank" not in r.stdout


# ---- declared, not applied -------------------------------------------------------------------------
KNOB_CASES = {
    "offload": {"offload": True},
    "shard_placement": {"shard_placement": "dim1", "model": ModelSpec(kind="mlp", widths=(16, 32, 16, 8))},
    "ignored": {"ignored": ("layers.1.linear.bias",)},
    "grad_reduction": {"grad_reduction": "sum"},
    "prefetch": {"prefetch": 1},
    "experts": {"model": ModelSpec(kind="mlp", widths=(16, 33, 17, 8), experts=2)},
    # aot_eager: the reference compiles before the ranks start (verify/runner.py), and Inductor's
    # code generation took 10 s of this test for a run the knobs check stops at its build
    "compile": {"compile": "units", "compile_backend": "aot_eager"},
    "groups": {"wrap": ("layers.0+layers.1", "")},
}


def knob_case(world: int, engine: str, **changes):
    return mlp_case(world, engine=engine, microbatches=changes.pop("microbatches", 1)).with_(**changes)


@pytest.mark.parametrize("knob", sorted(KNOB_CASES))
def test_a_declared_knob_the_engine_drops_is_named_not_applied(fsdp_check, knob):
    engine = f"tests/engines/undelivered.py:drops_{knob}"
    verdict = fsdp_check(knob_case(2, engine, **KNOB_CASES[knob]))
    assert not verdict.ok
    first = verdict.first_divergence
    field = ENGINE_KNOBS[knob].field
    assert (first.step, first.phase, first.name, first.comparator) == (0, "build", f"<{field}>", "KnobsApplied")
    assert f"did not apply `{field}`" in first.message, first.message
    assert len(verdict.failures) == 1  # the run stopped: nothing it would have broken is reported
    assert "Hint" not in verdict.summary()  # the model-build hint is the build check's, not this one's


def test_a_knob_another_rank_finds_not_applied_is_named_with_that_rank(fsdp_check):
    """Rank 0 reports; the rank that found the knob not applied says which and why."""
    verdict = fsdp_check(knob_case(2, "tests/engines/undelivered.py:drops_prefetch_off_rank_0", prefetch=1))
    first = verdict.first_divergence
    assert not verdict.ok and (first.phase, first.name) == ("build", "<prefetch>"), verdict.summary()
    assert "did not apply `prefetch`" in first.message and "rank 1: no unit has" in first.message, first.message


def test_the_engines_that_drop_a_knob_are_correct_without_it(fsdp_check):
    verdict = fsdp_check(mlp_case(2, engine="tests/engines/undelivered.py:drops_offload", prefetch=1))
    assert verdict.ok, verdict.summary()


@pytest.mark.parametrize(
    "changes",
    [
        {"offload": True, "shard_placement": "mixed", "grad_reduction": "sum", **KNOB_CASES["experts"]},
        {"offload": True, "shard_placement": "mixed", "prefetch": 2, "grad_reduction": "sum"},
        {"ignored": ("layers.1",), "shard_placement": "dim1", "prefetch": 1, "grad_reduction": "sum"},
    ],
)
def test_a_plugin_passing_the_spec_through_takes_every_knob(fsdp_check, changes):
    verdict = fsdp_check(knob_case(3, EVERYTHING, microbatches=2, **changes))
    assert verdict.ok, verdict.summary()
    assert any(f.comparator == "KnobsApplied" and f.ok for f in verdict.findings)  # it was judged


# ---- a collective mismatch ---------------------------------------------------------------------------
def test_a_collective_mismatch_is_named_with_the_phase_and_the_ranks(fsdp_check):
    with pytest.raises(RankFailure) as e:
        fsdp_check(mlp_case(2, engine="tests/engines/faulty.py:ranks_all_reduce_different_sizes"))
    text = str(e.value)
    assert e.value.kind == "crash" and "a collective mismatch between ranks" in text, text
    assert "rank 0 in 'step 1 forward (micro-batch 0)'" in text and "rank 1 in 'step 1 forward" in text
    assert fsdp_check(mlp_case(2)).ok  # the pool recovered
