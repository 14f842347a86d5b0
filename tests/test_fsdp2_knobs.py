"""fully_shard's knobs (issue 28, items 1-2): `offload` (CPUOffloadPolicy(pin_memory=False)) and
`shard_placement` (shard_placement_fn: Shard(1), mixed placements). A correct FSDP2 run passes
bit-exact at world sizes 1 to 4 and on a (2, 2) HSDP mesh, communication and memory contracts
included; each knob's mutant is caught with the knob on and invisible with it off; engines
without the knobs refuse them as bad input."""

from dataclasses import replace

import pytest
from hypothesis import given, settings

from fsdp_verify.case import Case, ModelSpec
from fsdp_verify.case_specs import DataSpec, OptimSpec
from fsdp_verify.checks.comm import check_comm, expected_collectives, measured_collectives
from fsdp_verify.checks.memory import offload_findings
from fsdp_verify.checks.prefetch import forward_pass
from fsdp_verify.engines.capabilities import ENGINE_KNOBS
from fsdp_verify.engines.placement import shard_dim
from fsdp_verify.engines.prefetch import prefetch_lists
from fsdp_verify.models import parameter_names
from fsdp_verify.properties.strategies import cases
from fsdp_verify.runner import refuse_untakeable
from fsdp_verify.sharded.pool import get_pool
from fsdp_verify.validation import CaseError
from tests.conftest import MLP, TINY_LM, lm_case, mlp_case, regression
from tests.found import find

MESHES = [(1, None), (2, None), (3, None), (4, None), (4, (2, 2))]
ADAM = OptimSpec(name="adam")


def _inexact(verdict) -> list:
    return [(f.key, f.max_abs) for f in verdict.findings if f.phase != "param_sums" and f.max_abs not in (0, None)]


def _knob_case(world: int, mesh, **knobs) -> Case:
    # MLP widths 16, 33, 17, 8: dim 1 of 16, 33 and 17 -> Shard(1) for one layer at 2, 3 and 4
    # ranks (uneven dim-0 shards everywhere else: 33 and 17 rows), every layer at 1 rank.
    return mlp_case(world, **{"mesh_shape": mesh, "clip_norm": 0.01, "microbatches": 2, "optim": ADAM, **knobs})


@pytest.mark.parametrize(("world", "mesh"), MESHES)
@pytest.mark.parametrize("knobs", [{"offload": True}, {"shard_placement": "dim1"}, {"shard_placement": "mixed"}])
def test_correct_fsdp2_with_the_knob_is_bit_exact(fsdp_check, world, mesh, knobs):
    """Numbers, and the comm and memory contracts: under Shard(1) a shard is the dim-1 chunk
    (numel / S), not dim 0 padded to S rows; without `placement_dims` both contracts flag it."""
    verdict = fsdp_check(_knob_case(world, mesh, **knobs), calibrate=False)
    assert verdict.ok, verdict.summary()
    assert not _inexact(verdict)
    phases = {f.phase for f in verdict.findings}
    assert {"comm", "memory"} <= phases, phases


def test_transformer_mixed_placements_offloaded_under_bf16_passes(fsdp_check):
    case = lm_case(3, shard_placement="mixed", offload=True, microbatches=2, sync_every_microbatch=False)
    verdict = fsdp_check(case.with_(**{"precision.param_dtype": "bf16", "precision.reduce_dtype": "fp32"}))
    assert verdict.ok, verdict.summary()


@pytest.mark.parametrize(
    ("mutant", "on", "off", "phase"),
    [
        ("offload_grad_added_twice", {"offload": True}, {"offload": False}, "grads"),
        ("shard1_cut_on_dim0", {"shard_placement": "dim1"}, {"shard_placement": "dim0"}, "init"),
    ],
)
@pytest.mark.parametrize(("world", "mesh"), [(2, None), (4, (2, 2))])
def test_the_knobs_mutant_is_caught_only_with_the_knob(fsdp_check, mutant, on, off, phase, world, mesh):
    engine = f"fsdp_verify.zoo.mutants:{mutant}"
    caught = fsdp_check(_knob_case(world, mesh, engine=engine, **on))
    assert not caught.ok
    assert caught.first_divergence.phase == phase, caught.summary()
    assert fsdp_check(_knob_case(world, mesh, engine=engine, **off)).ok


@pytest.mark.parametrize("engine", ["fsdp1", "flat", "fsdp_verify.zoo.mutants:fsdp1_hybrid_replicas_not_reduced"])
@pytest.mark.parametrize(
    ("field", "value"),
    [("offload", True), ("shard_placement", "dim1"), ("reshard_after_backward_last", True), ("prefetch", 1)],
)
def test_engines_without_the_knobs_refuse_them(engine, field, value):
    why = "does not declare" if field in ENGINE_KNOBS else "declares its module does not take"
    with pytest.raises(CaseError, match=rf"^{field}: expected .*engine '{engine}' {why} `{field}`"):
        refuse_untakeable(mlp_case(2, engine=engine, **{field: value}))


def test_bad_knob_values_name_the_field():
    with pytest.raises(CaseError, match=r"^shard_placement: expected one of \('dim0', 'dim1', 'mixed'\)"):
        mlp_case(2, shard_placement="dim2")
    with pytest.raises(CaseError, match=r"^offload: expected true or false"):
        mlp_case(2, offload=1)


def test_knobs_at_their_defaults_keep_a_cases_json_and_hash():
    assert "offload" not in Case().to_dict() and "shard_placement" not in Case().to_dict()
    assert Case().hash == Case(offload=False, shard_placement="dim0").hash
    assert Case(offload=True).hash != Case().hash


def test_the_placement_rule():
    """Shard(1) only where the shard group divides dim 1 (FSDP2's reduce-scatter refuses an
    uneven Shard(1)); vectors, uneven and too-narrow dims stay Shard(0); `mixed` mixes."""
    assert shard_dim("dim1", "w", (33, 16), 4) == 1
    assert shard_dim("dim1", "w", (16, 33), 4) == 0  # uneven
    assert shard_dim("dim1", "w", (16, 3), 4) == 0  # narrower than the group
    assert shard_dim("dim1", "b", (16,), 1) == 0
    assert shard_dim("dim0", "w", (33, 16), 4) == 0
    names = [f"layers.{i}.weight" for i in range(8)]
    assert {shard_dim("mixed", n, (8, 8), 2) for n in names} == {0, 1}


def test_offload_contract_names_sharded_state_off_the_cpu():
    """The memory contract's *where* (the probe records device types): on this CPU-only host a
    correct run can only be on the CPU, so the contract's teeth are shown on a record."""
    case = mlp_case(2, offload=True)
    rec = {"where": {"sharded": ["cpu"], "grads": ["cpu", "cuda"], "optim": ["cpu"]}}
    found = offload_findings(case, 1, rec)
    assert [f.name for f in found] == ["offload:grads"]
    assert "rank 1 holds gradients on cuda" in found[0].message
    assert offload_findings(mlp_case(2), 1, rec) == []  # without offload: held where the engine likes


@settings(max_examples=25, deadline=None, database=None)
@given(cases(engine="fsdp1", world_sizes=(2,)))
def test_an_engine_without_the_knobs_is_never_drawn_them(case):
    knobs = (case.offload, case.shard_placement, case.reshard_after_backward_last, case.grad_reduction, case.ignored)
    assert knobs == (False, "dim0", False, "avg", ())
    assert case.prefetch is None


def test_fsdp2_draws_the_knobs():
    found = find(cases(world_sizes=(2,)), lambda c: c.offload and c.shard_placement == "mixed")
    assert found.offload and found.shard_placement == "mixed"


# ---- replica_sync_last (issue 28, item 3): HSDP accumulation without the replica all-reduce ----
@pytest.mark.parametrize("mesh", [(2, 2), (4, 1), (1, 4)])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_hsdp_accumulation_without_the_replica_all_reduce_is_bit_exact(fsdp_check, mesh, precision):
    """Each replica reduce-scatters every micro-batch and keeps the sum in reduce_dtype; the
    replicas all-reduce once (the reference's `partial`): emulated as the all-reduce of every
    micro-batch, (2, 2) fp32 was 0.307x its tolerance, not equal. The comm contract counts one
    all-reduce per unit and step."""
    case = _knob_case(4, mesh, replica_sync_last=True, microbatches=3)
    if precision == "bf16":
        case = case.with_(**{"precision.param_dtype": "bf16", "precision.reduce_dtype": "bf16"})
    verdict = fsdp_check(case, calibrate=False)
    assert verdict.ok, verdict.summary()
    assert not _inexact(verdict)


@pytest.mark.parametrize(
    ("mutant", "phase"),
    [("replica_all_reduce_skipped_on_last", "grads"), ("replica_all_reduce_every_microbatch", "comm")],
)
def test_hsdp_accumulation_mutants_are_caught(fsdp_check, mutant, phase):
    engine = f"fsdp_verify.zoo.mutants:{mutant}"
    caught = fsdp_check(_knob_case(4, (2, 2), replica_sync_last=True, engine=engine))
    assert not caught.ok
    assert caught.first_divergence.phase == phase, caught.summary()
    assert fsdp_check(_knob_case(4, (2, 2), engine=engine)).ok  # the knob off: the correct engine


def test_replica_sync_last_needs_replicas_and_the_toolkits_loop():
    with pytest.raises(CaseError, match=r"^replica_sync_last: expected false on a 1-D mesh"):
        mlp_case(2, replica_sync_last=True)


def test_shard1_with_an_int_reshard_after_forward_is_refused():
    """FSDP2 crashes there (tests/upstream/test_fsdp2_shard1_int_reshard_after_forward.py)."""
    with pytest.raises(CaseError, match=r"^shard_placement: expected 'dim0' with an int reshard_after_forward 2"):
        mlp_case(4, shard_placement="dim1", reshard_after_forward=2)
    mlp_case(4, shard_placement="dim1", reshard_after_forward=4)  # == True: the whole group


@settings(max_examples=30, deadline=None, database=None)
@given(cases(world_sizes=(4,), hsdp=True))
def test_drawn_cases_never_combine_shard1_with_an_int_reshard(case):
    rsf = case.reshard_after_forward
    if case.shard_placement != "dim0" and not isinstance(rsf, bool):
        assert not 1 < rsf < case.mesh[-1]


# ---- reshard_after_backward_last (issue 28, item 3): unsharded parameters kept between micro-batches ----
@pytest.mark.parametrize(("world", "mesh"), MESHES)
def test_keeping_parameters_unsharded_between_microbatches_is_bit_exact(fsdp_check, world, mesh):
    """`set_reshard_after_backward(False)` before all but the last micro-batch: the numbers are
    the reference's unchanged; the comm contract expects no forward all-gather after the first
    micro-batch and the memory contract allows the units the previous backward left unsharded
    (without the model of either, both flag it)."""
    verdict = fsdp_check(_knob_case(world, mesh, reshard_after_backward_last=True, microbatches=3), calibrate=False)
    assert verdict.ok, verdict.summary()
    assert not _inexact(verdict)
    assert {"comm", "memory"} <= {f.phase for f in verdict.findings}


@pytest.mark.parametrize("rsf", [True, False, 2])
def test_kept_unsharded_beside_a_frozen_embedding_no_backward_reaches(fsdp_check, rsf):
    """A frozen embedding fed token ids (tests/regressions/8608cf484d42.json, 4 ranks): its own
    backward never runs, so the next micro-batch's forward all-gathers it again (True: though
    the implicit prefetch gathered it in backward; 2: over the 2 ranks of its post-forward
    shards), and under reshard_after_forward False every unit stays unsharded. Without
    `held_after_backward` the comm contract flagged the first two (an all-gather of 32 B)."""
    case = regression("8608cf484d42").with_(
        microbatches=3,
        sync_every_microbatch=True,
        reshard_after_forward=rsf,
        reshard_after_backward_last=True,
        **{"data.batch_size": 12},
    )
    verdict = fsdp_check(case, calibrate=False)
    assert verdict.ok, verdict.summary()


def test_kept_unsharded_once_a_frozen_embedding_is_unfrozen(fsdp_check):
    """A sweep's false alarm (tests/regressions/1f5d560296b7.json): unfrozen at step 2, the
    embedding's own backward runs, so it is held between micro-batches from then on."""
    verdict = fsdp_check(regression("1f5d560296b7"), calibrate=False)
    assert verdict.ok, verdict.summary()


@pytest.mark.parametrize(
    ("mutant", "phase"),
    [("unsharded_kept_after_the_last_backward", "grads"), ("reshard_after_backward_ignored", "comm")],
)
@pytest.mark.parametrize(("world", "mesh"), [(2, None), (4, (2, 2))])
def test_reshard_after_backward_mutants_are_caught(fsdp_check, mutant, phase, world, mesh):
    engine = f"fsdp_verify.zoo.mutants:{mutant}"
    caught = fsdp_check(_knob_case(world, mesh, reshard_after_backward_last=True, microbatches=3, engine=engine))
    assert not caught.ok
    assert caught.first_divergence.phase == phase, caught.summary()
    assert fsdp_check(_knob_case(world, mesh, microbatches=3, engine=engine)).ok  # the knob off: the correct engine


def test_reshard_after_backward_last_is_a_flag_and_drawn():
    with pytest.raises(CaseError, match=r"^reshard_after_backward_last: expected true or false"):
        mlp_case(2, reshard_after_backward_last="yes")
    assert "reshard_after_backward_last" not in Case().to_dict()
    assert Case(reshard_after_backward_last=True).hash != Case().hash
    found = find(cases(world_sizes=(2,)), lambda c: c.reshard_after_backward_last and c.microbatches > 1)
    assert found.reshard_after_backward_last


# ---- grad_reduction (issue 28, item 4): set_gradient_divide_factor(1.0), the loss divided by W ----
@pytest.mark.parametrize(("world", "mesh"), MESHES)
def test_a_sum_reduction_with_the_loss_divided_is_bit_exact(fsdp_check, world, mesh):
    """Each rank's loss / W, FSDP2 summing over the shard group and the replicas (no division
    anywhere): the reference divides the same losses and sums in gloo's order. Without its
    `_divide_factors` (1, 1) it divides the sum again and the gradients are 1/W off."""
    verdict = fsdp_check(_knob_case(world, mesh, grad_reduction="sum"), calibrate=False)
    assert verdict.ok, verdict.summary()
    assert not _inexact(verdict)


def test_a_sum_reduction_in_bf16_with_sync_last_on_hsdp_passes(fsdp_check):
    case = _knob_case(4, (2, 2), grad_reduction="sum", sync_every_microbatch=False, replica_sync_last=False)
    verdict = fsdp_check(case.with_(**{"precision.param_dtype": "bf16", "precision.reduce_dtype": "fp32"}))
    assert verdict.ok, verdict.summary()


@pytest.mark.parametrize(
    ("mutant", "where"),
    [
        ("sum_reduction_loss_not_divided", ("grads", 1, "GradsComparator")),
        # the divide factor left at FSDP2's default is a knob not applied: named at the build
        ("sum_reduction_factor_left_at_avg", ("build", 0, "KnobsApplied")),
    ],
)
@pytest.mark.parametrize(("world", "mesh"), [(2, None), (4, (2, 2))])
def test_sum_reduction_mutants_are_caught_before_or_in_the_first_gradients(fsdp_check, mutant, where, world, mesh):
    engine = f"fsdp_verify.zoo.mutants:{mutant}"
    caught = fsdp_check(_knob_case(world, mesh, grad_reduction="sum", engine=engine))
    assert not caught.ok
    first = caught.first_divergence
    assert (first.phase, first.step, first.comparator) == where, caught.summary()
    assert fsdp_check(_knob_case(world, mesh, engine=engine)).ok  # avg: the correct engine


def test_grad_reduction_is_a_flag_refused_with_a_users_step_and_drawn():
    with pytest.raises(CaseError, match=r"^grad_reduction: expected one of \('avg', 'sum'\)"):
        mlp_case(2, grad_reduction="mean")
    with pytest.raises(CaseError, match=r"^grad_reduction: expected 'avg' with a user's step"):
        mlp_case(2, grad_reduction="sum", step="tests/user/steps.py:train_step")
    for engine in ("fsdp1", "flat"):
        with pytest.raises(CaseError, match=rf"^grad_reduction: expected 'avg': engine '{engine}' does not declare"):
            refuse_untakeable(mlp_case(2, engine=engine, grad_reduction="sum"))
    assert "grad_reduction" not in Case().to_dict()
    assert Case(grad_reduction="sum").hash != Case().hash
    assert find(cases(world_sizes=(2,)), lambda c: c.grad_reduction == "sum").grad_reduction == "sum"


# ---- ignored (issue 28, item 4): fully_shard's ignored_params, reduced by the loop ----
_IGNORED = ("layers.1.linear.bias", "layers.2")  # part of one unit and a whole one


@pytest.mark.parametrize(("world", "mesh"), MESHES)
def test_ignored_parameters_the_loop_reduces_are_bit_exact(fsdp_check, world, mesh):
    """Unsharded, unreduced by FSDP2, all-reduced by the loop after the last backward: the
    reference sums the same per-rank gradients in gloo's order; ownership expects them
    unmanaged, comm their all-reduce (and no FSDP2 collective for the ignored unit), memory
    them whole on every rank."""
    verdict = fsdp_check(_knob_case(world, mesh, ignored=_IGNORED, clip_norm=None), calibrate=False)
    assert verdict.ok, verdict.summary()
    assert not _inexact(verdict)
    assert {"ownership", "comm", "memory"} <= {f.phase for f in verdict.findings}


def test_an_ignored_tied_embedding_under_a_sum_reduction_passes(fsdp_check):
    """The tied embedding and output weight, one parameter, ignored (both uses unmanaged), with
    sync-last accumulation and `grad_reduction: sum` (the loop's all-reduce then sums too)."""
    model = replace(TINY_LM, tie_embeddings=True)
    case = lm_case(3, microbatches=2, sync_every_microbatch=False)
    verdict = fsdp_check(case.with_(model=model, ignored=("tok_embeddings",), grad_reduction="sum"))
    assert verdict.ok, verdict.summary()


def test_a_frozen_ignored_unit_passes(fsdp_check):
    case = mlp_case(2, microbatches=2).with_(model=replace(MLP, frozen=("layers.0",)), ignored=("layers.0",))
    verdict = fsdp_check(case)
    assert verdict.ok, verdict.summary()


@pytest.mark.parametrize(("world", "mesh"), [(2, None), (4, (2, 2))])
def test_ignored_gradients_left_unreduced_are_caught_in_the_first_gradients(fsdp_check, world, mesh):
    engine = "fsdp_verify.zoo.mutants:ignored_grads_not_reduced"
    caught = fsdp_check(_knob_case(world, mesh, ignored=_IGNORED, clip_norm=None, engine=engine))
    assert not caught.ok
    first = caught.first_divergence
    assert (first.phase, first.step) == ("grads", 1), caught.summary()
    assert fsdp_check(_knob_case(world, mesh, clip_norm=None, engine=engine)).ok  # nothing ignored: correct


def test_ignored_across_a_resume_passes_and_a_lost_load_of_it_is_caught(fsdp_check):
    """The ignored parameters are saved and loaded as the plain, replicated tensors they are, onto
    another world size too; a load that drops one (a non-strict load of a renamed key: it is the
    model's first) is caught right after the resume."""
    case = mlp_case(2, ignored=("layers.0",), steps=3, resume_after=1, resume_world_size=3, data=DataSpec(batch_size=6))
    verdict = fsdp_check(case)
    assert verdict.ok, verdict.summary()
    lost = fsdp_check(case.with_(engine="fsdp_verify.zoo.mutants:prefixed_key_dropped_on_resume"))
    assert not lost.ok and lost.first_divergence.phase == "resumed", lost.summary()
    assert lost.first_divergence.name == "params.layers.0.linear.weight", lost.summary()  # the ignored one


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"ignored": ("output.weight",)}, r"names of the model's parameters .*'output.weight' names none"),
        ({"ignored": ("tok_embeddings", "layers", "norm")}, r"to leave FSDP at least one parameter"),
        ({"ignored": ("norm",), "clip_norm": 1.0}, r"empty with clip_norm"),
        ({"ignored": ("norm",), "precision.param_dtype": "bf16"}, r"empty with param_dtype bf16"),
        ({"ignored": ("norm",), "step": "tests/user/steps.py:train_step"}, r"empty with a user's step"),
    ],
)
def test_ignored_that_cannot_work_is_refused_naming_the_field(changes, expected):
    with pytest.raises(CaseError, match=rf"^ignored: expected {expected}"):
        lm_case(2).with_(model=replace(TINY_LM, tie_embeddings=True), **changes)


def test_ignored_is_a_flag_refused_by_engines_without_it_and_drawn():
    for engine in ("fsdp1", "flat"):
        with pytest.raises(CaseError, match=rf"^ignored: expected \(\): engine '{engine}' does not declare"):
            refuse_untakeable(mlp_case(2, engine=engine, ignored=("layers.0",)))
    assert "ignored" not in Case().to_dict()
    assert Case.from_json(mlp_case(2, ignored=("layers.0",)).to_json()).ignored == ("layers.0",)
    found = find(cases(world_sizes=(2,)), lambda c: bool(c.ignored))
    assert found.clip_norm is None


# ---- prefetch (issue 28, item 3): explicit forward and backward prefetching, k units ahead ----
def test_the_prefetch_lists():
    """Forward: the next k units in pre-forward (registration) order, the root first; backward:
    the next k in the reverse of the post-forward order (a nested unit finishes before its
    parent). Units without a parameter take no place; the last in backward order gets none
    (FSDP2's implicit prefetch there, which has no predecessor)."""
    plan = ("layers.0.attn", "layers.0", "layers.1", "empty", "out", "")
    names = ["emb.weight", "layers.0.attn.w", "layers.0.w", "layers.1.w", "out.weight"]
    assert prefetch_lists(plan, names, 2) == {
        "": (["layers.0", "layers.0.attn"], ["out", "layers.1"]),
        "layers.0": (["layers.0.attn", "layers.1"], ["layers.0.attn"]),
        "layers.0.attn": (["layers.1", "out"], []),
        "layers.1": (["out"], ["layers.0", "layers.0.attn"]),
        "out": ([], ["layers.1", "layers.0"]),
    }


@pytest.mark.parametrize(("world", "mesh"), MESHES)
@pytest.mark.parametrize("k", [1, 2])
def test_explicit_prefetching_is_bit_exact_and_its_memory_exact(fsdp_check, world, mesh, k):
    """The numbers are the reference's unchanged; the memory contract judges, after each unit's
    forward, the all-gather outputs of the units prefetched and not yet used (plus the one FSDP2
    keeps from the last copy-out) exactly as FSDP2 2.13 holds them."""
    verdict = fsdp_check(_knob_case(world, mesh, prefetch=k), calibrate=False)
    assert verdict.ok, verdict.summary()
    assert not _inexact(verdict)
    assert {"comm", "memory"} <= {f.phase for f in verdict.findings}


@pytest.mark.parametrize("k", [1, 2])
def test_backward_prefetch_reaches_a_frozen_embedding_behind_a_frozen_norm(fsdp_check, k):
    """tests/regressions/3845c252c6e9.json: no backward runs through the frozen embedding nor the
    frozen norm after it. The implicit prefetch (and k = 1, the same rule) gathers the norm only;
    k = 2 puts the embedding in the layer's backward list too, and FSDP2 gathers it (16 B,
    measured). Under the implicit rule alone the comm contract called that all-gather
    unexpected."""
    verdict = fsdp_check(regression("3845c252c6e9").with_(prefetch=k), calibrate=False)
    assert verdict.ok, verdict.summary()


@pytest.mark.parametrize(("world", "mesh"), [(2, None), (4, (2, 2))])
def test_prefetch_mutant_is_caught_by_memory_only(fsdp_check, world, mesh):
    """Lists one unit too long: the same numbers and collectives, one unit's all-gather output
    more held after a forward; with the knob off the mutant is the correct engine."""
    engine = "fsdp_verify.zoo.mutants:prefetch_one_unit_too_many"
    caught = fsdp_check(_knob_case(world, mesh, prefetch=1, engine=engine))
    assert not caught.ok
    assert caught.first_divergence.phase == "memory", caught.summary()
    assert {f.phase for f in caught.findings if not f.ok} == {"memory"}, caught.summary()
    assert fsdp_check(_knob_case(world, mesh, engine=engine)).ok


def test_prefetch_is_a_flag_and_drawn():
    for bad in (0, "2", 1.5, True):
        with pytest.raises(CaseError, match=r"^prefetch: expected null .*or a positive integer"):
            mlp_case(2, prefetch=bad)
    assert "prefetch" not in Case().to_dict()
    assert Case(prefetch=1).hash != Case().hash != Case(prefetch=2).hash
    found = find(cases(world_sizes=(2,)), lambda c: c.prefetch == 2)
    assert found.prefetch == 2


@pytest.mark.parametrize("k", [1, 2])
def test_a_checkpointed_recompute_reissues_the_forward_prefetch(fsdp_check, k):
    """tests/regressions/b6e1935bfeb3.json: recomputing the checkpointed `layers.0` runs its
    nested unit `layers.0.linear`'s pre-forward before that unit's pre-backward, so FSDP2 takes
    the forward path and prefetches `layers.1.linear` again, which has finished its backward:
    one more backward all-gather (measured, torch 2.13), which the comm contract called
    unexpected before `regathered_in_recompute` (found with routed experts, b070a41d5468; pinned
    without them since `prefetch` with experts is refused)."""
    verdict = fsdp_check(regression("b6e1935bfeb3").with_(prefetch=k), calibrate=False)
    assert verdict.ok, verdict.summary()


@pytest.mark.parametrize("name", ["da7e0255f22a", "18ce68532461"])  # a (1, 2) mesh; (2, 1), resumed
def test_prefetch_sweep_false_alarm_stays_fixed(fsdp_check, name):
    """Seed 20263711's sweep and the resume sweep's (20263963): the partial reduce outputs of
    `replica_sync_last` held after a later micro-batch's forward, on a shard group of one too."""
    verdict = fsdp_check(regression(name), calibrate=False)
    assert verdict.ok, verdict.summary()
    assert {f.comparator: f.ok for f in verdict.findings if f.comparator == "MemoryContract"} == {
        "MemoryContract": True
    }


def test_prefetch_beside_a_whole_ignored_unit_passes_the_contracts(fsdp_check):
    """A unit whose parameters are all `ignored` has no FSDP2 parameter group: no prefetch list
    names it, and the unit before it stays the one copied out last (56897d71339e: the memory
    contract allowed 648 B after its forward where FSDP2 rightly held 2,892 B; found writing
    issue 37's pass-through plug-in test)."""
    verdict = fsdp_check(regression("56897d71339e"), calibrate=False)
    assert verdict.ok, verdict.summary()
    assert {"comm", "memory"} <= {f.phase for f in verdict.findings if f.kind == "check"}
    case = regression("56897d71339e")
    assert prefetch_lists(case.wrap_plan, parameter_names(case.model), 1, case.ignored) == {
        "layers.0": (["layers.2"], []),
        "layers.2": ([], ["layers.0"]),
    }


SWIGLU = ["layers.0.attention", "layers.0.feed_forward.w3", "layers.0.feed_forward.w2", "layers.0", ""]  # run order
SWIGLU_LISTS = {  # k = 1 in registration order: w2 before w3
    "": ["layers.0"],
    "layers.0": ["layers.0.attention"],
    "layers.0.attention": ["layers.0.feed_forward.w2"],
    "layers.0.feed_forward.w2": ["layers.0.feed_forward.w3"],
}


def test_the_forward_replayed_in_run_order():
    """verify/checks/prefetch.py: `w2`'s forward list names `w3`, which ran before it. Resharded
    after forward, `w3` is gathered again and stays pending into backward; under an int k from
    its post-forward shards, over k ranks; kept unsharded, nothing is issued. The output FSDP2
    keeps is the unit copied out last in run order (`w2`), freed by the root's post-forward."""
    units = set(SWIGLU)
    resharded = forward_pass(SWIGLU, units, SWIGLU_LISTS, 3, True)
    w2, w3 = "layers.0.feed_forward.w2", "layers.0.feed_forward.w3"
    assert [u for u, _ in resharded.gathers] == ["", "layers.0", "layers.0.attention", w2, w3, w3]
    assert {g for _, g in resharded.gathers} == {3} and resharded.pending == {w3}
    after = {b.unit: b for b in resharded.boundaries}
    assert (after[w3].pending, after[w3].kept) == ({w2}, w3)
    assert (after[w2].pending, after[w2].kept) == ({w3}, w2)
    assert (after[""].pending, after[""].kept) == ({w3}, None)
    by_k = forward_pass(SWIGLU, units, SWIGLU_LISTS, 4, 2)
    assert by_k.gathers[-1] == (w3, 2) and by_k.pending == {w3}
    assert {b.unit: b.post_forward for b in by_k.boundaries}[""] == units
    kept = forward_pass(SWIGLU, units, SWIGLU_LISTS, 3, False)
    assert [u for u, _ in kept.gathers] == ["", "layers.0", "layers.0.attention", w2, w3] and not kept.pending
    assert {b.unit: b.kept for b in kept.boundaries}[w2] == w2  # not w3, the last registered
    assert forward_pass(SWIGLU, units, SWIGLU_LISTS, 1, True).gathers == ()  # a shard group of one


@pytest.mark.parametrize("name", ["36a0532e74ce", "f8b28b06ee82"])  # reshard_after_forward False; True, 4 micro-batches
def test_prefetch_out_of_registration_order_passes_the_contracts(fsdp_check, name):
    """Issue 48: the SwiGLU's `w2`, registered before `w3` and run after it, as units of their
    own at 3 ranks, `prefetch` 1 (tests/regressions/README.md). The memory contract allowed the
    all-gather output of the unit last in registration order (`w3`, 24 B) where FSDP2 keeps the
    one it copied out last (`w2`'s 36 B); the comm contract called `w2`'s list's second gather of
    `w3` (576 B) unexpected, and expected the backward gather that forward gather replaces. Both
    contracts run and pass, and a list one unit too long is still caught by memory."""
    verdict = fsdp_check(regression(name), calibrate=False)
    assert verdict.ok, verdict.summary()
    assert {"comm", "memory"} <= {f.phase for f in verdict.findings if f.kind == "check"}
    mutant = fsdp_check(regression(name).with_(engine="fsdp_verify.zoo.mutants:prefetch_one_unit_too_many"))
    assert not mutant.ok and mutant.first_divergence.phase == "memory", mutant.summary()


def test_the_forward_gather_of_a_unit_that_already_ran_is_backwards():
    """f8b28b06ee82 (reshard_after_forward True, 4 micro-batches): per micro-batch `w3` is
    gathered twice in forward (its own pre-forward, then `w2`'s list) and not in backward, where
    its pre-backward copies out the pending forward gather; measured and expected alike."""
    case = regression("f8b28b06ee82")
    got = get_pool(case.world_size).run(case, 300)
    assert check_comm(case, None, got) == []
    w3 = "layers.0.feed_forward.w3"
    expected = [
        (c.microbatch, c.phase) for c in expected_collectives(case, got) if c.unit == w3 and c.kind == "all_gather"
    ]
    assert sorted(expected) == sorted((m, "forward") for m in range(4) for _ in range(2))
    for rank in measured_collectives(got):
        gathers = [c for c in rank if c.kind == "all_gather" and c.bytes == 576 and c.phase == "forward"]
        assert len(gathers) == 4 * 3  # w3 twice and the attention once, in each micro-batch


def test_prefetch_with_routed_experts_is_refused_naming_the_field():
    """The MLP's `moe` is registered after the layers it runs before: a backward list naming a
    unit whose backward already ran was modelled (1b9ded5281a8, gathered again), but a forward
    list naming a unit that already ran is not (a memory false alarm, 4,624 B against 544 B, in
    the merged draw's first sweep): refused, not drawn."""
    with pytest.raises(CaseError, match=r"^prefetch: expected null with routed experts"):
        mlp_case(3, mesh_shape=(1, 3), prefetch=2).with_(**{"model.experts": 2})
    found = find(cases(world_sizes=(2,), model_kinds=("mlp",)), lambda c: c.model.experts > 0)
    assert found.prefetch is None


def test_a_transformer_recompute_reissues_no_forward_prefetch(fsdp_check):
    """Seed 20263711's false alarm (docs/fsdp2-knobs.md): units nested three deep in a
    checkpointed Transformer block; FSDP2 gathers nothing again in backward, where b6e1935bfeb3's
    MLP gathers a target again. When a recompute re-issues a forward list is not modelled, so
    that all-gather is allowed, not required: the comm contract judges the rest and passes."""
    verdict = fsdp_check(regression("fca52d9137dc"), calibrate=False)
    assert verdict.ok, verdict.summary()
    from fsdp_verify.engines.contracts import case_contracts

    # not judged at all now: a recompute under prefetch is outside the contracts (case_contracts)
    assert not case_contracts(regression("fca52d9137dc").with_(reshard_after_backward_last=False)).comm


def test_prefetch_contracts_are_not_applied_where_they_are_not_modelled():
    """The closing sweeps' 15 contract false alarms (seeds 20263951-2): prefetch on a user's model
    (run order unknown) and beside reshard_after_backward_last. The contracts are n/a there,
    saying why; the built-in models without it keep both (the mutant above is caught by memory)."""
    from fsdp_verify.engines.contracts import case_contracts

    custom = mlp_case(2, prefetch=1).with_(model=ModelSpec(kind="custom", factory="fsdp_verify.models.hf:tiny_llama"))
    rabl = mlp_case(2, prefetch=1, microbatches=2, reshard_after_backward_last=True)
    checkpointed = mlp_case(2, prefetch=1, activation_checkpointing=True)
    cases_and_whys = (
        (custom, "a user's model"),
        (rabl, "reshard_after_backward_last"),
        (checkpointed, "checkpointing"),
    )
    for case, why in cases_and_whys:
        contracts = case_contracts(case)
        assert not contracts.comm and not contracts.memory and why in contracts.why, contracts
    kept = case_contracts(mlp_case(2, prefetch=1, microbatches=2))
    assert kept.comm and kept.memory
