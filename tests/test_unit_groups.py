"""One FSDP2 unit over several modules (`fully_shard([norm, output])`, spelled "norm+output" in a
wrap plan: verify/units.py), as torchtitan shards its `[norm, lm_head]` and, tied, its
`[tok_embeddings, norm, lm_head]`: one unit everywhere (ownership, both contracts, the knobs check,
the draw, zoom), read from what the engine built, and refused where it is not modelled."""

from __future__ import annotations

import pytest
from hypothesis import find, settings

from fsdp_verify import units
from fsdp_verify.case import Case, ModelSpec
from fsdp_verify.case_specs import DataSpec, PrecisionSpec
from fsdp_verify.checks.ownership import check_map, expected_params, expected_ties
from fsdp_verify.engines.ownership import OwnershipMap
from fsdp_verify.properties.pins import PinError
from fsdp_verify.properties.strategies import cases
from fsdp_verify.properties.unit_groups import group_candidates
from fsdp_verify.runner import check_case
from fsdp_verify.sharded.pool import get_pool
from fsdp_verify.validation import CaseError
from tests.conftest import regression
from tests.found import FOUND
from tests.in_process import run_cli

PLAIN = "examples/engine/my_engine.py:shard"
EVERYTHING = "examples/engine/my_engine.py:shard_everything"
MLP = ModelSpec(kind="mlp", widths=(8, 6, 5, 4))
LM = ModelSpec(kind="transformer", vocab_size=32, dim=16, n_layers=2, n_heads=2, ffn_hidden=24, seq_len=4)
FIND = settings(FOUND, max_examples=400)


def _case(world: int, model: ModelSpec = MLP, **changes) -> Case:
    return Case(model=model, world_size=world, steps=2, data=DataSpec(batch_size=2 * world)).with_(**changes)


# ---- the spelling and what is refused ---------------------------------------------------------------
def test_a_group_is_one_unit_owning_every_member():
    plan = ("layers.0.linear", "tok_embeddings+norm+output", "")
    assert units.members("norm+output") == ("norm", "output") and units.members("") == ("",)
    assert units.owner_of_param(plan, "output.weight") == "tok_embeddings+norm+output"
    assert units.owner_of_param(plan, "layers.0.linear.weight") == "layers.0.linear"
    assert units.owner_of_param(plan, "layers.1.linear.weight") == ""
    assert units.inside("layers.0.linear+layers.0.dropout", "layers.0")
    assert not units.inside("layers.0+layers.1", "layers.0")


@pytest.mark.parametrize(
    ("wrap", "changes", "expected"),
    [
        (("layers.1+layers.0", ""), {}, "a group's modules in the model's order"),
        (("layers.0+layers.0.linear", ""), {}, "a group of modules none inside another"),
        (("layers.0+", ""), {}, "other than the root"),
        (("layers.0+nope", ""), {}, "module names of the model other than the root"),
        (("layers.0+layers.1", "layers.0", ""), {}, "each module at most once"),
        (("layers.0+layers.1", ""), {"prefetch": 1}, "units of one module each beside prefetch"),
    ],
)
def test_a_group_the_toolkit_cannot_model_is_refused_naming_the_plan(wrap, changes, expected):
    with pytest.raises(CaseError) as e:
        _case(2, wrap=wrap, **changes)
    assert e.value.field_path == "wrap" and expected in str(e.value), str(e.value)


def test_a_group_beside_tensor_parallelism_is_bit_exact(fsdp_check):
    """torchtitan's `[norm, lm_head]` unit under its tp (tests/test_torchtitan.py), here FSDP2's
    own: one unit over the sequence-parallel norm and the vocabulary-sharded head, dp 2 x tp 2."""
    case = _case(4, LM, wrap=("layers.0", "layers.1", "norm+output", ""), tp=2, sequence_parallel=True, steps=1)
    verdict = fsdp_check(case.with_(loss_parallel=True, clip_norm=0.5))
    assert verdict.ok, verdict.summary()
    numbers = [f for f in verdict.findings if f.kind == "deviation" and f.phase in ("grads", "params")]
    assert numbers and all(f.max_abs == 0 for f in numbers)


LM4 = ModelSpec(kind="transformer", vocab_size=31, dim=16, n_layers=4, n_heads=2, ffn_hidden=23, seq_len=6)


def _pp(wrap: tuple[str, ...], **changes) -> Case:
    """Two stages of two blocks each (the first with the embedding, the last with norm and head),
    dp 2 each, two micro-batches."""
    base = Case(model=LM4, world_size=4, pp=2, microbatches=2, sync_every_microbatch=False, steps=2)
    return base.with_(data=DataSpec(batch_size=8), wrap=wrap, **changes)


def test_groups_beside_pipeline_parallelism_are_bit_exact_and_one_across_two_stages_is_refused(fsdp_check):
    """torchtitan's `[norm, lm_head]` in its last stage: each stage is sharded on its own, so a
    group lies in one stage (the Case refuses one across two); bf16 parameters, a clip over the
    stages; every number bit-exact."""
    wrap = ("tok_embeddings", "layers.0+layers.1", "layers.2", "layers.3", "norm+output", "")
    case = _pp(wrap, clip_norm=0.3, precision=PrecisionSpec(param_dtype="bf16", reduce_dtype="fp32"))
    verdict = fsdp_check(case)
    assert verdict.ok, verdict.summary()
    numbers = [f for f in verdict.findings if f.kind == "deviation" and f.phase in ("grads", "params")]
    assert numbers and all(f.max_abs == 0 for f in numbers)
    with pytest.raises(CaseError) as e:
        _pp(("layers.0", "layers.1+layers.2", "layers.3", ""))
    assert e.value.field_path == "wrap" and "'layers.1+layers.2' lies in stages [0, 1]" in str(e.value)


def test_a_group_sharded_module_by_module_in_a_stage_is_caught(fsdp_check):
    wrap = ("layers.0", "layers.1", "layers.2", "layers.3", "norm+output", "")
    verdict = fsdp_check(_pp(wrap, engine="fsdp_verify.zoo.mutants:group_sharded_module_by_module"))
    first = verdict.first_divergence
    assert (first.step, first.phase, first.name) == (0, "build", "<wrap>"), verdict.summary()
    assert "the modules of 'norm+output' are not one unit" in first.message


def test_an_engine_that_does_not_declare_groups_is_refused_them_and_never_drawn():
    r = run_cli(["check", "--model", "mlp", "--widths", "8,6,5,4", "--engine", PLAIN, "--wrap", "layers.0+layers.1"])
    assert r.returncode == 2, r.stdout + r.stderr
    assert "wrap: expected units of one module each: engine" in r.stderr and "`groups`" in r.stderr, r.stderr
    with pytest.raises(PinError, match="wrap: expected units of one module each"):
        cases(engine=PLAIN, wrap=("layers.0+layers.1", ""), model="mlp")
    with pytest.raises(Exception, match="Unsatisfiable|No examples"):  # noqa: B017 (hypothesis's own)
        find(cases(engine=PLAIN), lambda c: any(units.is_group(u) for u in c.wrap_plan), settings=FIND)


# ---- the draw --------------------------------------------------------------------------------------
def test_the_draw_groups_sibling_units_and_torchtitans_tied_unit():
    mlp = find(cases(model_kinds=("mlp",)), lambda c: any(units.is_group(u) for u in c.wrap_plan), settings=FIND)
    group = next(u for u in mlp.wrap_plan if units.is_group(u))
    parents = {m.rpartition(".")[0] for m in units.members(group)}
    assert len(parents) == 1, group  # siblings
    tied = find(  # tied embeddings pinned: the search is for the group, not for the tie (seconds saved)
        cases(model_kinds=("transformer",), **{"model.tie_embeddings": True}),
        lambda c: any(units.is_group(u) for u in c.wrap_plan),
        settings=FIND,
    )
    assert any(u.startswith("tok_embeddings+") and u.endswith("+output") for u in tied.wrap_plan), tied.wrap_plan
    assert find(cases(engine=EVERYTHING), lambda c: any(units.is_group(u) for u in c.wrap_plan), settings=FIND)


def test_candidates_are_runs_of_siblings_next_to_each_other():
    case = _case(2, LM, wrap=("layers.0", "layers.1", "norm", "output", ""))
    found = group_candidates(case)
    assert ("layers.0", "layers.1") in found and ("norm", "output") in found
    assert ("layers.1", "norm") not in found  # not siblings


# ---- real runs ----------------------------------------------------------------------------------------
GROUPED = [
    pytest.param(_case(3, wrap=("layers.0+layers.1", ""), precision=PrecisionSpec("bf16", "fp32")), id="mlp-3-bf16"),
    pytest.param(_case(4, LM, wrap=("layers.0", "layers.1", "norm+output", ""), mesh_shape=(2, 2)), id="lm-hsdp"),
    pytest.param(
        _case(3, LM.__class__(**{**LM.__dict__, "tie_embeddings": True}), wrap=("tok_embeddings+norm+output", "")),
        id="lm-tied-torchtitan",
    ),
    pytest.param(
        _case(2, wrap=("layers.0+layers.1", ""), reshard_after_forward=False, microbatches=2), id="mlp-kept-2mb"
    ),
]


@pytest.mark.parametrize("case", GROUPED)
def test_fsdp2_with_a_group_is_equivalent(fsdp_check, case):
    verdict = fsdp_check(case)
    assert verdict.ok, verdict.summary()
    checked = {f.comparator for f in verdict.findings if f.kind == "check"}
    assert {"OwnershipCheck", "CommContract", "MemoryContract"} <= checked, checked


def test_the_map_names_the_group_as_the_engine_built_it():
    """(The equivalence runs' ownership check holds every parameter to the plan's unit; here the
    map itself, on the tied Transformer's torchtitan unit.)"""
    case = GROUPED[2].values[0]
    got = get_pool(case.world_size).run(case)
    ownership = OwnershipMap.from_json(got.meta["ownership"])
    assert check_map(case, ownership, expected_params(case), expected_ties(case)) == []
    group = next(u for u in case.wrap_plan if units.is_group(u))
    owned = [n for n, own in ownership.params.items() if own.units == (group,)]
    assert owned and all(units.covers(group, n.rpartition(".")[0]) for n in owned), ownership.params


def test_a_group_sharded_module_by_module_is_caught_before_the_first_step(fsdp_check):
    """The engine declares `groups` and shards each member on its own: the knobs check names it
    (the run stops); the ownership check, on the map such an engine builds, names the units."""
    case = _case(3, wrap=("layers.0+layers.1", ""), engine="fsdp_verify.zoo.mutants:group_sharded_module_by_module")
    verdict = fsdp_check(case)
    first = verdict.first_divergence
    assert (first.step, first.phase, first.name) == (0, "build", "<wrap>"), verdict.summary()
    assert "the modules of 'layers.0+layers.1' are not one unit" in first.message
    split = OwnershipMap.from_json(get_pool(3).run(_case(3, wrap=("layers.0", "layers.1", ""))).meta["ownership"])
    found = check_map(case, split, expected_params(case), expected_ties(case))
    assert any("owned by 'layers.0', but the wrap plan puts it in 'layers.0+layers.1'" in f.message for f in found)


def test_the_memory_contract_still_catches_an_unsharded_copy_beside_a_group(fsdp_check):
    """A group held unsharded across the blocks (tied) is allowed exactly while it is open: an
    engine that keeps the root's unsharded parameters is still caught."""
    tied = LM.__class__(**{**LM.__dict__, "tie_embeddings": True})
    case = _case(
        3,
        tied,
        wrap=("tok_embeddings+norm+output", "layers.0", ""),
        engine="fsdp_verify.zoo.mutants:retains_full_params",
    )
    verdict = fsdp_check(case)
    assert not verdict.ok and any(f.phase == "memory" for f in verdict.failures), verdict.summary()


# ---- each unit's reshard_after_forward, as the engine built it ------------------------------------------
TITAN_LIKE = "tests/engines/torchtitan_like.py:shard"


@pytest.mark.parametrize("world, mesh", [(2, None), (3, None), (4, (2, 2))], ids=["2", "3", "2x2"])
def test_the_contracts_take_each_units_reshard_as_built(fsdp_check, world, mesh):
    """torchtitan's way (blocks resharded, `[norm, output]` and the root not): before each unit
    was read from its state the comm contract expected `norm+output`'s backward all-gather
    ("expected all_gather ... none issued")."""
    case = _case(world, LM, wrap=("tok_embeddings", "layers.0", "layers.1", "norm+output", ""), engine=TITAN_LIKE)
    verdict = fsdp_check(case.with_(mesh_shape=mesh) if mesh else case)
    assert verdict.ok, verdict.summary()
    checked = {f.comparator for f in verdict.findings if f.kind == "check"}
    assert {"CommContract", "MemoryContract"} <= checked, checked


def test_an_engine_that_ignores_reshard_after_forward_is_named(fsdp_check):
    case = _case(2, reshard_after_forward=False, engine="tests/engines/torchtitan_like.py:always_reshards")
    first = fsdp_check(case).first_divergence
    assert (first.step, first.phase, first.name) == (0, "build", "<reshard_after_forward>"), first
    assert "unit 'layers.0' was built with True, the case asks False" in first.message


def test_a_group_whose_members_are_checkpointed_inside_a_checkpointed_unit_passes():
    """tests/regressions/7b220140646b.json: `layers.1.linear+layers.1.dropout` inside `layers.1`,
    activation checkpointing on every unit, world size 2, bf16 parameters. Found by
    `fuzz --engine fsdp2 --hsdp --precisions fp32 bf16 fp16 --world-sizes 1 2 3 4 --seed 4931`
    (the 1,107th of 1,129 cases); without the group, or without checkpointing, it passes. Measured
    with FSDP2's own hooks spied: the group's post_backward runs in backward (its reduction), and
    the root's final callback finds it IDLE rather than POST_BACKWARD and runs it again, which
    issues a second reduction (16 B reduce-scatter; an all-reduce over the replicas under HSDP).
    FSDP2's own, with plain torch (tests/upstream/test_fsdp2_unused_params_group_reduced_twice.py:
    `set_reduce_scatter_unused_params(True)`, which the toolkit sets for routed experts); the
    communication contract allows that second reduction (`reduced_again`), never requires it."""
    from fsdp_verify.checks.comm import reduced_again

    case = regression("7b220140646b")
    verdict = check_case(case)
    assert verdict.ok, verdict.summary()
    # what is allowed, and where: the group only, and only under checkpointing with unused-params reduction
    assert reduced_again(case, "layers.1.linear+layers.1.dropout") and not reduced_again(case, "layers.0.linear")
    assert not reduced_again(case.with_(activation_checkpointing=False), "layers.1.linear+layers.1.dropout")


# A fuzz false alarm once groups were drawn beside tp (seed 6204, shrunk to
# tests/regressions/8b8f7ef3f51f.json): a checkpointed unit over `attention_norm` and `attention`
# recomputes its forward in backward, re-issuing the rowwise output's tp all-reduce there; the tp
# contract looked for layers inside a recomputed unit by its name's prefix, which a group's name
# ("layers.0.attention_norm+layers.0.attention") is not of its members' layers.
def test_a_checkpointed_group_beside_tp_is_held_to_the_tp_contract(fsdp_check):
    case = regression("8b8f7ef3f51f")
    assert units.is_group(case.wrap_plan[0]) and case.activation_checkpointing and case.tp == 2
    verdict = fsdp_check(case, calibrate=False)
    assert verdict.ok, verdict.summary()
    assert any(f.comparator == "CommContract" and f.kind == "check" for f in verdict.findings)
