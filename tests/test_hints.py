"""Hints from evidence (verify/hints.py, verify/evidence.py), on Traces made by hand: each cause
is named where the records show it and not where they show something close to it. The same
hints on real runs of the zoo's mutants: tests/test_resume.py and tests/test_mutants.py."""

from __future__ import annotations

import pytest
import torch

from fsdp_verify.case import Case, ModelSpec
from fsdp_verify.case_specs import DataSpec
from fsdp_verify.compare.comparators import compare_traces
from fsdp_verify.hints import hint
from fsdp_verify.sharded.collect import RANK_ROWS
from fsdp_verify.trace import Trace
from fsdp_verify.training.resume import FRESH_PARAM_GROUPS

K = 1  # the step saved after


def _traces(saved: dict[str, torch.Tensor], loaded: dict[str, torch.Tensor], init=None, meta=None):
    ref = Trace("reference", {(K, "resumed", n): t for n, t in saved.items()})
    for n, t in (init or {}).items():
        ref.records[(0, "init", n)] = t
    got = Trace("sharded", {(K, "resumed", n): t for n, t in loaded.items()}, dict(meta or {}))
    for n, t in (init or {}).items():  # both sides built the same model
        got.records[(0, "init", n)] = t
    return ref, got


def _hint(ref: Trace, got: Trace, world_size: int = 2) -> str:
    first = next(f for f in compare_traces(ref, got) if not f.ok)
    return hint(first, ref, got, world_size)


def _rows(n: int, *ranks: int) -> list[list[int]]:
    """Rows 0..n split evenly over `ranks`, in order."""
    per = n // len(ranks)
    return [[r, i * per, (i + 1) * per] for i, r in enumerate(ranks)]


A, B = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([5.0, 6.0, 7.0, 8.0])
THIRDS = torch.tensor([1 / 3, 2 / 3, 1.1, 4.3])


# ---- the loaded state of a resume ---------------------------------------------------------------
def test_two_states_landed_on_each_other_are_named_swapped():
    saved = {"optim.a.exp_avg": A, "optim.b.exp_avg": B}
    said = _hint(*_traces(saved, {"optim.a.exp_avg": B, "optim.b.exp_avg": A}))
    assert "the loaded a.exp_avg is the saved b.exp_avg and the loaded b.exp_avg is the saved a.exp_avg" in said
    assert "swapped" in said


def test_one_state_loaded_under_another_name_is_mis_keyed_not_swapped():
    saved = {"optim.a.exp_avg": A, "optim.b.exp_avg": B}
    said = _hint(*_traces(saved, {"optim.a.exp_avg": B, "optim.b.exp_avg": B}))
    assert "is the saved b.exp_avg" in said and "mis-keyed" in said and "swapped" not in said


def test_another_state_entry_of_the_same_values_is_not_taken_for_a_swap():
    """Only the same entry of another parameter counts: an exp_avg equal to some exp_avg_sq is
    not evidence of a swap."""
    saved = {"optim.a.exp_avg": A, "optim.a.exp_avg_sq": B}
    said = _hint(*_traces(saved, {"optim.a.exp_avg": B, "optim.a.exp_avg_sq": B}))
    assert "swapped" not in said and "mis-keyed" not in said
    assert "differs from the saved one" in said and "it is none of" in said


def test_a_state_at_bf16_rounding_is_named_with_its_dtype_and_near_it_is_only_described():
    saved = {"optim.a.exp_avg": THIRDS}
    rounded = THIRDS.to(torch.bfloat16).float()
    said = _hint(*_traces(saved, {"optim.a.exp_avg": rounded}))
    assert (
        "is the saved value rounded to bf16" in said
        and "stored or passed in bf16, a lower precision than its float32" in said
    )
    said = _hint(*_traces(saved, {"optim.a.exp_avg": THIRDS.half().float()}))
    assert "rounded to fp16" in said
    # bf16 rounding and then one more ulp somewhere: not the rounding, described
    moved = rounded.clone()
    moved[0] = torch.nextafter(moved[0], torch.tensor(2.0))
    said = _hint(*_traces(saved, {"optim.a.exp_avg": moved}))
    assert (
        "it was stored or passed in" not in said
        and "it is none of: another record's saved value, its rows in another order, the saved value rounded to"
        " bf16 or fp16"
        in said
    )


def test_rows_in_another_order_are_named_and_one_ulp_off_them_only_described():
    """Experts loaded into other slots: each loaded row is a saved row, moved (not whole chunks
    moved round, which the shard hint names: it reads first)."""
    experts = torch.arange(12.0).reshape(4, 3) / 7
    moved = experts[[1, 0, 3, 2]]
    said = _hint(*_traces({"params.moe.w": experts}, {"params.moe.w": moved}))
    assert "holds the saved rows in another order" in said and "[1, 0, 3, 2][i]" in said, said
    rotated = _hint(*_traces({"params.moe.w": experts}, {"params.moe.w": experts[[2, 3, 0, 1]]}))
    assert "2 chunks along dim 0 moved round by 1" in rotated and "other ranks" in rotated, rotated
    near = moved.clone()
    near[0, 0] = torch.nextafter(near[0, 0], torch.tensor(9.0))
    said = _hint(*_traces({"params.moe.w": experts}, {"params.moe.w": near}))
    assert "holds the saved rows" not in said and "it is none of" in said, said


def test_zeros_where_state_was_saved_are_a_fresh_optimizers_and_no_state_at_all_too():
    saved = {"optim.a.exp_avg": A, "optim.a.step": torch.tensor(3.0)}
    said = _hint(*_traces(saved, {"optim.a.exp_avg": torch.zeros(4), "optim.a.step": torch.tensor(3.0)}))
    assert "all zeros" in said and "fresh optimizer" in said
    said = _hint(*_traces(saved, {}))
    assert "holds no state" in said and "fresh optimizer" in said
    # state held for others but not this one: not a fresh optimizer
    saved["optim.b.exp_avg"] = B
    said = _hint(*_traces(saved, {"optim.b.exp_avg": B}))
    assert "though it holds state for others" in said and "fresh optimizer" not in said


def test_a_step_count_of_zero_is_a_reset_and_another_wrong_count_is_described():
    saved = {"optim.a.step": torch.tensor(3.0)}
    assert "reset on resume" in _hint(*_traces(saved, {"optim.a.step": torch.tensor(0.0)}))
    said = _hint(*_traces(saved, {"optim.a.step": torch.tensor(2.0)}))
    assert "reset" not in said and "it is none of" in said


def test_a_parameter_at_its_initial_value_is_a_key_not_loaded_and_another_value_is_described():
    init = {"w": A}
    saved = {"params.w": B}
    said = _hint(*_traces(saved, {"params.w": A}, init=init))
    assert "holds its initial values" in said and "not loaded" in said
    said = _hint(*_traces(saved, {"params.w": A + 1}, init=init))
    assert "initial" in said and "it is none of" in said and "not loaded" not in said


def _generators(expected: list[int], loaded: list[int]) -> str:
    """The hint for the generators right after a load at step K: the saving run's two ranks ended
    step K's last micro-batch (1) on streams 10 and 20 (its micro-batch 0 on 5 and 6)."""
    ref, got = _traces({"rng": torch.tensor(expected)}, {"rng": torch.tensor(loaded)})
    for side in (ref, got):  # the saving run's own records, alike on both sides
        side.records[(K, "rng", "after_backward.0")] = torch.tensor([5, 6])
        side.records[(K, "rng", "after_backward.1")] = torch.tensor([10, 20])
    return _hint(ref, got)


def test_generators_of_the_saving_runs_other_ranks_are_named_restored_onto_the_wrong_ranks():
    # Resumed at tp 2 (one data-parallel rank: both ranks on saved rank 0's stream); rank 1 took
    # saved rank 1's, as a loop restoring by global rank does.
    said = _generators([10, 10], [10, 20])
    assert "rank(s) [1]" in said and "saving run's rank(s) [1]" in said and "wrong ranks" in said, said
    # Near misses: a stream the saving run's ranks ended on only before the last micro-batch, or
    # a fresh one, is no saving rank's generator: not restored, no rank named.
    for loaded in ([10, 6], [10, 99]):
        said = _generators([10, 10], loaded)
        assert "not restored" in said and "wrong ranks" not in said, said


def test_a_state_whose_chunks_moved_round_is_named_shards_on_other_ranks_and_near_it_is_described():
    saved = torch.arange(12.0).reshape(6, 2)
    said = _hint(*_traces({"params.w": saved}, {"params.w": torch.cat([saved[2:], saved[:2]])}))
    assert "3 chunks along dim 0 moved round by 1" in said and "other ranks" in said, said
    near = torch.cat([saved[2:], saved[:2]])
    near[0, 0] += 1  # one element off: no rotation
    said = _hint(*_traces({"params.w": saved}, {"params.w": near}))
    assert "other ranks" not in said and "it is none of" in said, said


def _by_rank(saved_w, loaded_w, init_w, ranks=(0, 1)):
    rows = {f"{K}/resumed/params.w": _rows(len(saved_w), *ranks)}
    return _traces({"params.w": saved_w}, {"params.w": loaded_w}, init={"w": init_w}, meta={RANK_ROWS: rows})


def test_only_some_ranks_shards_wrong_are_named_and_fresh_shards_say_where_the_load_went():
    init, saved = torch.zeros(4), A
    said = _hint(*_by_rank(saved, torch.tensor([1.0, 2.0, 0.0, 0.0]), init))
    assert "rank(s) [1] differ" in said and "rank(s) [0] are the saved ones" in said
    assert "loaded on rank(s) [0] only" in said
    # rank 1's rows wrong but not the initial values: the ranks named, no cause
    said = _hint(*_by_rank(saved, torch.tensor([1.0, 2.0, 9.0, 9.0]), init))
    assert "rank(s) [1] differ" in said and "only" not in said
    # every rank's rows wrong: no rank named (here: the initial values everywhere, a key not loaded)
    said = _hint(*_by_rank(saved, init, init))
    assert "rank(s)" not in said and "holds its initial values" in said


def test_without_per_rank_rows_no_rank_is_named():
    """A view that makes its own full tensors (FSDP1, the flat engine) records no rank's rows."""
    init, saved = torch.zeros(4), A
    ref, got = _by_rank(saved, torch.tensor([1.0, 2.0, 0.0, 0.0]), init)
    got.meta.pop(RANK_ROWS)
    said = _hint(ref, got)
    assert "rank(s)" not in said and "it is none of" in said


def test_a_hyperparameter_is_compared_with_the_saved_and_the_built_value():
    saved = {"param_groups.weight_decay": torch.tensor([0.1], dtype=torch.float64)}
    loaded = {"param_groups.weight_decay": torch.tensor([0.0], dtype=torch.float64)}
    built = {FRESH_PARAM_GROUPS: {"param_groups.weight_decay": [0.1]}}
    said = _hint(*_traces(saved, loaded, meta=built))
    assert "is [0.0]" in said and "not the saved [0.1] nor the [0.1] the optimizer was built with" in said
    assert "set after the load" in said
    built = {FRESH_PARAM_GROUPS: {"param_groups.weight_decay": [0.0]}}
    said = _hint(*_traces(saved, loaded, meta=built))
    assert "the value the optimizer was built with" in said and "set after" not in said
    said = _hint(*_traces(saved, loaded))  # what it was built with not recorded: described only
    assert "not the saved [0.1]" in said and "built" not in said and "set after" not in said


# ---- the step hints -------------------------------------------------------------------------------
G = {"a": torch.tensor([1.0, -2.0, 3.0, 0.5]), "b": torch.tensor([0.25, 4.0]), "frozen": torch.zeros(2)}


def _grads(factors: dict[str, float], world_size: int = 2, rows=None) -> tuple[Trace, Trace]:
    ref = Trace("reference", {(1, "grads", n): t for n, t in G.items()})
    got = Trace("sharded", {(1, "grads", n): t * factors.get(n, 1.0) for n, t in G.items()})
    got.meta["items"] = {"1": [[2]] * world_size}
    if rows:
        got.meta[RANK_ROWS] = rows
    return ref, got


def test_every_gradient_a_world_size_multiple_names_the_division():
    said = _hint(*_grads({"a": 4.0, "b": 4.0}, world_size=4), world_size=4)
    assert "every gradient of the step is world_size x" in said and "too rarely" in said
    said = _hint(*_grads({"a": 1 / 3, "b": 1 / 3}, world_size=3), world_size=3)
    assert "1/world_size x" in said and "once too often" in said


def test_the_world_size_of_the_step_is_the_one_that_ran_it():
    """After a resume on 4 ranks a step's world size is 4, not the case's 2."""
    said = _hint(*_grads({"a": 4.0, "b": 4.0}, world_size=4), world_size=2)
    assert "(the world size: 4)" in said


def test_a_world_size_factor_on_some_gradients_is_described_not_explained():
    said = _hint(*_grads({"a": 0.5}), world_size=2)
    assert "1/world_size x" in said and "1 of the step's 2 gradients" in said
    assert "once too often" not in said


def test_twice_at_world_size_2_is_said_to_be_ambiguous_and_another_factor_is_no_world_size():
    said = _hint(*_grads({"a": 2.0, "b": 2.0}), world_size=2)
    assert "cannot tell" in said and "too rarely" not in said
    said = _hint(*_grads({"a": 2.0, "b": 2.0}, world_size=3), world_size=3)
    assert "2x the reference's" in said and "world size" not in said


def test_only_some_ranks_shards_of_a_gradient_differing_are_named_and_every_ranks_not():
    rows = {"1/grads/a": _rows(4, 0, 1)}
    ref, got = _grads({}, rows=rows)
    got.records[(1, "grads", "a")] = G["a"] * torch.tensor([1.0, 1.0, 1.01, 1.01])
    said = _hint(ref, got)
    assert "only rank(s) [1]'s shards of the reduced gradient a differ" in said
    got.records[(1, "grads", "a")] = G["a"] * torch.tensor([1.0001, 1.0, 1.01, 1.01])
    assert "only" not in _hint(ref, got)  # rank 0's rows moved too: no rank is right


# ---- the groups a gradient's factor names (tp, pp, ep: the world is not the data-parallel ranks) --
TP_MLP = ModelSpec(kind="mlp", widths=(16, 32, 18, 8))  # widths tp 2 splits
EXPERTS_MLP = ModelSpec(kind="mlp", widths=(16, 32, 18, 8), experts=4, top_k=1)
DIVISORS = "tests/engines/group_divisors.py:"


def _composed(world_size: int, model=TP_MLP, microbatches: int = 1, **changes) -> Case:
    data = DataSpec(batch_size=world_size * microbatches * 2)
    return Case(model=model, world_size=world_size, data=data, steps=1, microbatches=microbatches, **changes)


@pytest.mark.parametrize(
    ("group", "case", "says", "never"),
    [
        # dp 3 x tp 2: 1/3 is the data-parallel size alone
        (
            "dp",
            _composed(6, tp=2, engine=DIVISORS + "divides_by_dp_twice"),
            "every gradient of the step is 1/3 x the reference's (the world size 6: data-parallel 3 x tp 2):"
            " divided by the data-parallel size (3) once too often",
            ("world size (6)", "tp degree", "cannot tell"),
        ),
        # dp 1 x tp 2: the world taken for the data-parallel ranks, the tp ranks as replicas
        (
            "tp",
            _composed(2, tp=2, engine=DIVISORS + "divides_by_the_world"),
            "every gradient of the step is 1/2 x the reference's (the world size 2: data-parallel 1 x tp 2):"
            " divided by the world size (2) where the data-parallel size (1) was meant: the tp ranks counted as"
            " replicas",
            ("pp stages", "once too often", "cannot tell"),
        ),
        # pp 2 x dp 1: the same, the stages as replicas (3 micro-batches: at 2, dividing by them once
        # too often would fit as well, and both are named)
        (
            "pp",
            _composed(2, pp=2, microbatches=3, sync_every_microbatch=False, engine=DIVISORS + "divides_by_the_world"),
            "every gradient of the step is 1/2 x the reference's (the world size 2: pp 2 x data-parallel 1):"
            " divided by the world size (2) where the data-parallel size (1) was meant: the pp stages counted as"
            " replicas",
            ("tp ranks", "once too often", "cannot tell"),
        ),
        # ep 2 of dp 4: the experts' gradients alone, 1/2, the dense ones right
        (
            "ep",
            _composed(4, model=EXPERTS_MLP, ep=2, engine=DIVISORS + "experts_divided_by_ep"),
            "the experts' gradients (moe.experts.weight, moe.experts.bias) are 1/2 x the reference's and the"
            " others agree (the world size 4: data-parallel 4; ep 2): divided by the ep degree (2) once too often",
            ("data-parallel size (4)", "cannot tell", "world_size"),
        ),
        # dp 2 x tp 2: 1/4 is the world alone
        (
            "world",
            _composed(4, tp=2, engine=DIVISORS + "divides_by_the_world_twice"),
            "every gradient of the step is 1/4 x the reference's (the world size 4: data-parallel 2 x tp 2):"
            " divided by the world size (4) once too often",
            ("was meant", "data-parallel size (2) once", "cannot tell"),
        ),
    ],
)
def test_a_factor_of_one_groups_size_names_that_group_and_its_size(fsdp_check, group, case, says, never):
    """A real mutant a group: the hint names the group and its size from the case's mesh, and
    none of the others."""
    verdict = fsdp_check(case)
    assert not verdict.ok and verdict.first_divergence.phase == "grads", verdict.summary()
    assert says in verdict.hint, (group, verdict.hint)
    assert not any(n in verdict.hint for n in never), (group, verdict.hint)


def test_a_factor_two_groups_sizes_fit_names_both(fsdp_check):
    """dp 2 x tp 2, every unit dividing by the world (issue 48's plug-in): 1/2 is the world taken
    for the data-parallel ranks and the data-parallel size once too often; the records cannot
    tell which, so both are named."""
    verdict = fsdp_check(_composed(4, tp=2, engine=DIVISORS + "divides_by_the_world"))
    assert not verdict.ok
    assert verdict.hint == (
        "every gradient of the step is 1/2 x the reference's (the world size 4: data-parallel 2 x tp 2): divided by"
        " the world size (4) where the data-parallel size (2) was meant (the tp ranks counted as replicas), or"
        " divided by the data-parallel size (2) once too often (a division on top of the reduction's average); at"
        " these sizes the records cannot tell which"
    )


def test_a_pipeline_not_dividing_by_its_microbatches_names_them_and_not_a_group(fsdp_check):
    """The zoo's pp mutant (scale_grads off) at 3 micro-batches: 3 is no group's size, the
    micro-batches' count; at pp 2 x dp 1 nothing else fits."""
    mutant = "fsdp_verify.zoo.mutants:pp_loss_not_divided_by_microbatches"
    verdict = fsdp_check(_composed(2, pp=2, microbatches=3, sync_every_microbatch=False, engine=mutant))
    assert not verdict.ok
    assert verdict.hint == (
        "every gradient of the step is 3 x the reference's (the world size 2: pp 2 x data-parallel 1): not divided"
        " by the micro-batches (3): each micro-batch's loss scaled for their mean, the sum kept"
    )


def test_a_pipeline_dividing_by_its_microbatches_once_too_often_names_them(fsdp_check):
    """The same mutant where the case's schedule does not scale (`pp_scale_grads` false,
    torchtitan's): told to divide anyway, every gradient 1/3; at 3 micro-batches no group fits."""
    mutant = "fsdp_verify.zoo.mutants:pp_loss_not_divided_by_microbatches"
    case = _composed(2, pp=2, microbatches=3, sync_every_microbatch=False, pp_scale_grads=False, engine=mutant)
    verdict = fsdp_check(case)
    assert not verdict.ok
    assert verdict.hint == (
        "every gradient of the step is 1/3 x the reference's (the world size 2: pp 2 x data-parallel 1): divided by"
        " the micro-batches (3) once too often: the schedule's `scale_grads` on, where each micro-batch's loss is"
        " already its share of the step's"
    )


def _composed_grads(factors: dict[str, float], case: Case, grads=G) -> str:
    ref = Trace("reference", {(1, "grads", n): t for n, t in grads.items()})
    got = Trace("sharded", {(1, "grads", n): t * factors.get(n, 1.0) for n, t in grads.items()})
    got.meta["items"] = {"1": [[2]] * case.dp_size}
    first = next(f for f in compare_traces(ref, got) if not f.ok)
    return hint(first, ref, got, case.world_size, case=case)


def test_a_factor_no_group_is_or_on_some_gradients_names_no_group():
    at_dp2_tp2 = _composed(4, tp=2)
    said = _composed_grads({"a": 1 / 3, "b": 1 / 3}, at_dp2_tp2)  # 3 is no group's size
    assert said == "every gradient of the step is 0.3333x the reference's", said
    said = _composed_grads({"a": 0.5}, at_dp2_tp2)  # one gradient of two: described, no cause
    assert said.startswith("the gradient a is 1/2 x the reference's (the world size 4: data-parallel 2 x tp 2;")
    assert "1 of the step's 2 gradients" in said and "divided" not in said
    said = _composed_grads({"a": 0.5, "b": 0.5}, at_dp2_tp2)  # every gradient: both causes
    assert "was meant" in said and "data-parallel size (2) once too often" in said


def test_experts_are_named_only_where_the_experts_alone_have_the_factor():
    """Under ep with no expert among the records, or the factor on a dense gradient too, no
    expert cause; the plain wording where the world is the data-parallel ranks."""
    at_ep2 = _composed(4, model=EXPERTS_MLP, ep=2)
    said = _composed_grads({"a": 0.25}, at_ep2)
    assert "expert" not in said and said.startswith("the gradient a is 1/world_size x"), said
    said = _composed_grads({"a": 0.25, "b": 0.25}, at_ep2)
    assert said.endswith("(the world size: 4): divided by the world size once too often"), said
    with_experts = {**G, "moe.experts.weight": torch.tensor([0.5, -1.0, 2.0])}
    said = _composed_grads({"moe.experts.weight": 0.5}, at_ep2, with_experts)
    assert "divided by the ep degree (2) once too often" in said, said
    said = _composed_grads({"moe.experts.weight": 0.5, "a": 0.5}, at_ep2, with_experts)  # a dense one too
    assert "expert" not in said and "ep degree" not in said, said
