"""Ownership: the map from parameter to shard unit is a partition, and each way of breaking it is
named by the ownership check (phase "ownership", step 0, before any numeric record)."""

import json

import pytest
import torch

import fsdp_verify.zoo.mutants
from fsdp_verify.checks.ownership import check_map, expected_params, expected_ties
from fsdp_verify.commands.cli import main
from fsdp_verify.engines.ownership import OwnershipMap, ParamOwnership
from fsdp_verify.models import _construct
from fsdp_verify.sharded.pool import get_pool
from fsdp_verify.units import owner_of_module as _owner
from tests.conftest import lm_case, mlp_case

ENGINES = "tests/engines/shared_state.py"


def tied_frozen_lm(**changes):
    return lm_case(2, **changes).with_(**{"model.tie_embeddings": True, "model.frozen": ("layers.0.attention_norm",)})


def ownership_failures(verdict):
    return [f for f in verdict.failures if f.comparator == "OwnershipCheck"]


# ---- the correct engine -------------------------------------------------------------------------
@pytest.mark.parametrize("case", [mlp_case(2), tied_frozen_lm()], ids=["mlp", "tied-frozen-lm"])
def test_fsdp2_map_is_a_partition_by_the_wrap_plan(case):
    got = get_pool(2).run(case)
    ownership = OwnershipMap.from_json(got.meta["ownership"])
    assert check_map(case, ownership, expected_params(case), expected_ties(case)) == []
    assert set(ownership.params) == set(expected_params(case)) and ownership.unmanaged == ()
    assert ownership.params[
        "layers.0.attention_norm.weight" if case.model.kind != "mlp" else "layers.0.linear.bias"
    ].units == ("layers.0",)
    if case.model.kind == "mlp":  # 33 rows over 2 ranks: 17 + 16, the second padded by one row
        w = ownership.params["layers.0.linear.weight"]
        assert w.shape == (33, 16) and w.local_numel == (17 * 16, 16 * 16) and w.padding == (0, 16)
    else:  # the tied head is the embedding: one parameter, owned once, by the root
        assert "output.weight" not in ownership.params
        assert ownership.params["tok_embeddings.weight"].units == ("",)
        assert got.meta["ties"] == [["tok_embeddings.weight", "output.weight"]]
    assert all(not r["stale"] and not r["not_stepped"] and not r["foreign"] for r in got.meta["optimizer_params"])


def test_fsdp2_passes_every_check(fsdp_check):
    verdict = fsdp_check(tied_frozen_lm())
    assert verdict.ok, verdict.summary()


# ---- hand-built maps: each violation named, with both owners ------------------------------------
def _map(case) -> OwnershipMap:
    """The correct map for `case` at world size 2: rank 0 holds ceil(rows / 2) rows, rank 1 the
    rest and pads up to the same size."""
    with torch.device("meta"):
        model = _construct(case.model)
    params = {}
    for name, p in model.named_parameters():
        n, rows = p.numel(), p.shape[0]
        chunk = -(-rows // 2) * (n // rows)
        unit = _owner(case.wrap_plan, name.rsplit(".", 1)[0])
        params[name] = ParamOwnership(name, (unit,), tuple(p.shape), (chunk, n - chunk), (0, 2 * chunk - n))
    return OwnershipMap(params=params)


def test_a_parameter_in_two_units_names_both_owners():
    case = mlp_case(2)
    w = "layers.0.linear.weight"
    own = _map(case)
    own.params[w] = ParamOwnership(w, ("layers.0", ""), (33, 16), (272, 256), (0, 16))
    doubled = own
    findings = check_map(case, doubled, expected_params(case), [])
    assert [(f.phase, f.name) for f in findings] == [("ownership", w)]
    assert "'layers.0' and ''" in findings[0].message and "2 units" in findings[0].message


def test_wrong_owner_unmanaged_missing_and_bad_coverage_are_each_named():
    case = mlp_case(2)
    own = _map(case)
    b0, b1, w2 = "layers.0.linear.bias", "layers.1.linear.bias", "layers.2.linear.weight"
    own.params[b0] = ParamOwnership(b0, ("",), (33,), (17, 16), (0, 1))
    own.params[b1] = ParamOwnership(b1, ("layers.1",), (17,), (9, 9), (0, 0))
    del own.params[w2]
    own.unmanaged = (w2,)
    by_name = {f.name: f for f in check_map(case, own, expected_params(case), [])}
    assert set(by_name) == {b0, b1, w2}
    assert "owned by ''" in by_name[b0].message and "'layers.0'" in by_name[b0].message
    assert "hold 18 of its 17 elements" in by_name[b1].message
    assert by_name[w2].kind == "unmanaged"
    del own.params["layers.0.linear.weight"]
    assert any(f.kind == "missing" for f in check_map(case, own, expected_params(case), []))


def test_a_tied_weight_owned_separately_is_named_with_its_twin():
    case = lm_case(2).with_(**{"model.tie_embeddings": True})
    own = _map(case)
    assert check_map(case, own, expected_params(case), expected_ties(case)) == []
    head = ParamOwnership("output.weight", ("",), (61, 16), (496, 480), (0, 16))
    own.params["output.weight"] = head
    (finding,) = check_map(case, own, expected_params(case), expected_ties(case))
    assert finding.name == "output.weight" and "tied to 'tok_embeddings.weight'" in finding.message


# ---- broken engines, end to end -----------------------------------------------------------------
def test_tie_broken_by_sharding_is_caught_by_ownership(fsdp_check):
    verdict = fsdp_check(
        lm_case(2, engine="fsdp_verify.zoo.mutants:tie_broken_by_sharding").with_(**{"model.tie_embeddings": True})
    )
    first = verdict.first_divergence
    assert (first.step, first.phase, first.comparator) == (0, "ownership", "OwnershipCheck"), verdict.summary()
    kinds = {f.kind for f in ownership_failures(verdict)}
    assert {"tie", "unexpected"} <= kinds
    assert any(
        "'output.weight'" in f.message and f.name == "tok_embeddings.weight" for f in ownership_failures(verdict)
    )


def test_stale_optimizer_params_are_caught_by_ownership(fsdp_check):
    verdict = fsdp_check(mlp_case(2, engine="fsdp_verify.zoo.mutants:stale_optimizer_params"))
    first = verdict.first_divergence
    assert (first.step, first.phase, first.kind) == (0, "ownership", "optimizer"), verdict.summary()
    stale = {f.name for f in ownership_failures(verdict) if f.kind == "optimizer"}
    assert stale == set(expected_params(mlp_case(2)))


def test_a_unit_missing_from_the_wrap_is_caught_though_the_numbers_agree(fsdp_check):
    verdict = fsdp_check(mlp_case(2, engine=f"{ENGINES}:skips_first_unit"))
    ownership = [f for f in verdict.failures if f.phase == "ownership"]
    assert {f.name for f in ownership} == {"layers.0.linear.weight", "layers.0.linear.bias"}, verdict.summary()
    assert "owned by '', but the wrap plan puts it in 'layers.0'" in ownership[0].message
    assert verdict.first_divergence.phase == "ownership"
    # The only other finding is the memory contract's: the root keeps layers.0's parameters
    # unsharded through its whole forward, where the plan frees them after layers.0's.
    others = [f for f in verdict.failures if f.phase != "ownership"]
    assert {(f.phase, f.name) for f in others} == {("memory", "unsharded:layers.0")}, verdict.summary()


def test_parameters_outside_every_unit_are_unmanaged(fsdp_check):
    verdict = fsdp_check(lm_case(2, engine=f"{ENGINES}:root_not_wrapped"))
    unmanaged = {f.name for f in ownership_failures(verdict) if f.kind == "unmanaged"}
    assert unmanaged == {"tok_embeddings.weight", "norm.weight", "output.weight"}
    assert verdict.first_divergence.phase == "ownership"


@pytest.mark.skipif(
    not hasattr(fsdp_verify.zoo.mutants, "flat_nested_double_ownership"),
    reason="the FlatParameter engine has not landed",
)
def test_flat_parameter_nested_double_ownership_is_caught(fsdp_check):
    verdict = fsdp_check(mlp_case(2, engine="fsdp_verify.zoo.mutants:flat_nested_double_ownership"))
    first = verdict.first_divergence
    assert (first.step, first.phase) == (0, "ownership"), verdict.summary()
    assert "owned by 2 units: 'layers.0' and ''" in first.message


# ---- the report a person reads ------------------------------------------------------------------
def test_ownership_report_lists_units_params_shapes_and_shards(capsys, tmp_path):
    out_json = tmp_path / "own.json"
    assert main(["ownership", "--model", "mlp", "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "unit 'layers.0': 2 parameters, 561 elements" in text
    assert "unit '<root>'" not in text  # the MLP's root unit owns no parameter of its own
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("layers.0.linear.weight"))
    assert line.split()[1:] == ["33x16", "272", "256", "0/16"]
    assert "unmanaged: none" in text and "partition:" in text
    data = json.loads(out_json.read_text())
    assert data["units"]["layers.0"] == ["layers.0.linear.weight", "layers.0.linear.bias"]
    assert data["findings"] == []


def test_ownership_report_of_a_broken_engine_exits_1_and_names_the_violation(capsys):
    code = main(["ownership", "--model", "transformer", "--engine", f"{ENGINES}:skips_first_unit"])
    text = capsys.readouterr().out
    assert code == 1
    assert "NOT A PARTITION" in text and "'layers.0.attention.wq.weight': owned by ''" in text


def test_ownership_report_bad_input_exits_2(capsys):
    assert main(["ownership", "--world-size", "0"]) == 2
    assert "world_size" in capsys.readouterr().err
