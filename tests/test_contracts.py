"""The communication and memory contracts (issue 14): FSDP2's volume and memory modelled exactly;
each resource mutant computes the right numbers and is caught by its contract alone; the correct
engine passes both on generated cases; the commands print the tables."""

import pytest
from hypothesis import HealthCheck, given, settings

from fsdp_verify.case import Case, PrecisionSpec
from fsdp_verify.checks.comm import expected_collectives, measured_collectives
from fsdp_verify.commands.cli import main
from fsdp_verify.probes.comm import padded_shard_numel
from fsdp_verify.properties import cases
from fsdp_verify.runner import check_case
from fsdp_verify.sharded.pool import get_pool
from tests.conftest import lm_case, mlp_case, regression

CONTRACTS = ("CommContract", "MemoryContract")
BF16 = PrecisionSpec(param_dtype="bf16", reduce_dtype="fp32")


def contract_findings(verdict):
    return [f for f in verdict.findings if f.comparator in CONTRACTS]


def test_padding_is_fsdp2s_dim0_rounded_up_to_the_shard_group():
    assert padded_shard_numel([61, 32], 2) == 31 * 32  # 61 rows padded to 62, 31 per rank
    assert padded_shard_numel([61, 32], 4) == 16 * 32  # padded to 64
    assert padded_shard_numel([33], 3) == 11 and padded_shard_numel([1, 5], 4) == 5
    assert padded_shard_numel([], 2) == 1  # a 0-dim parameter is one row


def test_the_default_case_issues_exactly_the_hand_computed_collectives():
    """Built-in Transformer, 2 ranks: a layer holds 2x32 + 4x32x32 + 3x44x32 = 8,384 fp32
    elements (33,536 B, even rows: no padding); the root 61x32 twice padded to 62 rows plus 32:
    4,000 elements (16,000 B). Per step: 3 forward and 3 backward all-gathers, 3 reduce-scatters;
    the loop records without collectives (its one gather comes after the last step)."""
    case = Case(steps=1)
    got = get_pool(2).run(case, 120)
    for rank in measured_collectives(got):
        seen = sorted((c.phase, c.kind, c.dtype, c.group, c.bytes) for c in rank)
        layer, root = 33_536, 16_000
        want = [("backward", "all_gather", "fp32", 2, b) for b in (root, layer, layer)]
        want += [("backward", "reduce_scatter", "fp32", 2, b) for b in (root, layer, layer)]
        want += [("forward", "all_gather", "fp32", 2, b) for b in (root, layer, layer)]
        assert seen == sorted(want)
    assert sorted(c.bytes for c in expected_collectives(case, got)) == sorted(b for *_, b in want)


@pytest.mark.parametrize(
    "case",
    [
        lm_case(4, mesh_shape=(2, 2), precision=BF16, clip_norm=1.0, microbatches=2, sync_every_microbatch=False),
        lm_case(4, reshard_after_forward=2, precision=BF16),
        lm_case(2, reshard_after_forward=False, microbatches=2),
        mlp_case(3, clip_norm=0.01).with_(**{"model.frozen": ("layers.0.linear.weight",)}),
        lm_case(1, precision=BF16),
    ],
    ids=["hsdp-clip-nosync", "reshard-to-2", "no-reshard-2-microbatches", "mlp-3-ranks-frozen-clip", "one-rank-bf16"],
)
def test_the_correct_engine_meets_both_contracts(case):
    verdict = check_case(case)
    assert verdict.ok, verdict.summary()
    kinds = {f.comparator: f.kind for f in contract_findings(verdict)}
    assert kinds == {"CommContract": "check", "MemoryContract": "check"}  # ran, not skipped


@settings(max_examples=6, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(cases(world_sizes=(2, 3, 4), precisions=("fp32", "bf16"), hsdp=True, steps=1))
def test_the_correct_engine_meets_both_contracts_on_generated_cases(case):
    verdict = check_case(case)
    assert not [f for f in contract_findings(verdict) if not f.ok], verdict.summary()


MUTANTS = {
    "all_reduce_instead_of_reduce_scatter": ("CommContract", "reduce_scatter", lm_case(2)),
    "all_gather_in_fp32": ("CommContract", "all_gather", lm_case(2, precision=BF16)),
    "retains_full_params": ("MemoryContract", "unsharded", lm_case(2)),
}


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_a_resource_mutant_is_caught_by_its_contract_and_by_nothing_numeric(name):
    contract, what, case = MUTANTS[name]
    verdict = check_case(case.with_(engine=f"fsdp_verify.zoo.mutants:{name}"))
    failing = [f for f in verdict.findings if not f.ok]
    assert failing, verdict.summary()
    assert {f.comparator for f in failing} == {contract}, verdict.summary()
    assert verdict.first_divergence.comparator == contract and what in verdict.first_divergence.name
    if contract == "CommContract":  # names the unit and the collective it expected
        assert any("unit 'layers.0'" in f.message and what in f.message for f in failing)


def test_the_fp32_gather_is_twice_the_bytes_of_the_policys_bf16_gather():
    verdict = check_case(lm_case(2, precision=BF16, engine="fsdp_verify.zoo.mutants:all_gather_in_fp32"))
    message = next(f.message for f in verdict.findings if f.comparator == "CommContract" and not f.ok)
    assert "all_gather fp32 of 16,000 B over 2 ranks" in message or "all_gather fp32" in message, message
    assert "the model says all_gather bf16" in message


def test_a_retained_replica_is_caught_at_one_rank_too():
    verdict = check_case(lm_case(1, engine="fsdp_verify.zoo.mutants:retains_full_params"))
    assert [f.comparator for f in verdict.findings if not f.ok][:1] == ["MemoryContract"], verdict.summary()


def test_engines_outside_fsdp2s_model_are_not_held_to_it():
    verdict = check_case(mlp_case(2, engine="fsdp1"))
    assert verdict.ok, verdict.summary()
    assert {f.comparator: f.kind for f in contract_findings(verdict)} == {
        "CommContract": "skipped",
        "MemoryContract": "skipped",
    }


def test_comm_prints_the_table_for_the_default_case(capsys):
    assert main(["comm", "--steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "forward   layers.0  all_gather      fp32   2      33,536      33,536      ok" in out
    assert "contract holds: 9 collectives per rank" in out


def test_comm_exits_1_on_the_all_reduce_mutant(capsys):
    assert (
        main(["comm", "--steps", "1", "--engine", "fsdp_verify.zoo.mutants:all_reduce_instead_of_reduce_scatter"]) == 1
    )
    out = capsys.readouterr().out
    assert "reduce_scatter / all_reduce" in out and "CONTRACT BROKEN" in out


def test_memory_prints_the_per_rank_saving(capsys):
    assert main(["memory", "--steps", "1", "--world-size", "4"]) == 0
    out = capsys.readouterr().out
    assert "sharded params            = 20,896     20,896  20,896  20,896  20,896" in out
    assert "x less per rank at 4 ranks" in out and "contract holds" in out


def test_memory_exits_1_on_a_retained_replica(capsys):
    assert main(["memory", "--steps", "1", "--engine", "fsdp_verify.zoo.mutants:retains_full_params"]) == 1
    assert "CONTRACT BROKEN" in capsys.readouterr().out


def test_a_copy_that_is_no_parameter_is_caught_at_the_quiet_boundaries():
    verdict = check_case(lm_case(2, engine="tests/engines/memory_faults.py:retains_flat_copy"))
    failing = [f for f in verdict.findings if not f.ok]
    assert {f.comparator for f in failing} == {"MemoryContract"}, verdict.summary()
    assert all(f.name.startswith("other:") for f in failing), verdict.summary()
    assert "beyond its shards, gradients and buffers" in failing[0].message


def test_a_models_own_constant_tensor_is_not_the_engines():
    from fsdp_verify.case import DataSpec
    from fsdp_verify.models import ModelSpec

    model = ModelSpec(kind="custom", factory="tests.user.models:constant_scaled_lm", seq_len=8)
    case = Case(model=model, world_size=2, steps=2, data=DataSpec(batch_size=4))
    verdict = check_case(case)
    assert verdict.ok, verdict.summary()
    assert {f.comparator: f.kind for f in contract_findings(verdict)} == {
        "CommContract": "check",
        "MemoryContract": "check",
    }


def test_fsdp2s_post_forward_shard_of_a_unit_no_backward_runs_through_is_planned():
    """reshard_after_forward=2 on 4 ranks with a frozen embedding as its own unit: FSDP2 leaves that
    unit's 2-way post-forward shard alive after the step (verify/checks/memory.py). Allowed exactly:
    the correct engine passes, an extra copy on top is still caught."""
    case = regression("8608cf484d42")
    verdict = check_case(case)
    assert verdict.ok, verdict.summary()
    assert {f.comparator: f.kind for f in contract_findings(verdict)} == {
        "CommContract": "check",
        "MemoryContract": "check",
    }
    mutant = check_case(case.with_(engine="tests/engines/memory_faults.py:retains_flat_copy"))
    failing = [f for f in mutant.findings if not f.ok]
    assert {f.comparator for f in failing} == {"MemoryContract"}, mutant.summary()
    assert all(f.name.startswith("other:") for f in failing), mutant.summary()


def test_comm_names_fp16_loss_scaling_in_its_header(capsys):
    """The scaler's found-inf all-reduce happens outside the contract's windows: the header says
    the case scales its loss, so a reader knows what the table leaves out."""
    assert main(["comm", "--steps", "1", "--param-dtype", "fp16", "--loss-scaling"]) == 0
    header = capsys.readouterr().out.splitlines()[0]
    assert "fp16" in header and "loss scale 65536" in header, header
