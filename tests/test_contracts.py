"""The communication and memory contracts (issue 14): FSDP2's volume and memory modelled exactly;
each resource mutant computes the right numbers and is caught by its contract alone; the correct
engine passes both on generated cases; the commands print the tables."""

import pytest
from hypothesis import HealthCheck, given, settings

from fsdp_verify.case import Case
from fsdp_verify.case_specs import PrecisionSpec
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
    from fsdp_verify.case_specs import DataSpec
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


# ---- degenerate meshes and units no backward runs through (verify/checks/comm.py) ---------------
@pytest.mark.parametrize(
    ("world", "mesh"),
    [(2, (1, 2)), (2, (2, 1)), (4, (1, 4)), (4, (4, 1)), (4, (2, 2)), (1, None), (1, (1, 1))],
    ids=["1x2", "2x1", "1x4", "4x1", "2x2", "one-rank", "1x1"],
)
def test_the_correct_engine_meets_both_contracts_on_every_mesh_shape(world, mesh):
    """(1, W) and (1, 1): FSDP2 all-reduces each unit over one replica (a 2-D mesh is HSDP to it,
    whatever the replicas); (W, 1): no all-gather or reduce-scatter, an all-reduce over W; world
    size 1 on a 1-D mesh: nothing at all. Before the model knew, (1, W) was DIVERGED."""
    verdict = check_case(mlp_case(world, mesh_shape=mesh, steps=1, clip_norm=1.0))
    assert verdict.ok, verdict.summary()
    assert {f.comparator: f.kind for f in contract_findings(verdict)} == {
        "CommContract": "check",
        "MemoryContract": "check",
    }


# A fuzz false alarm (tests/regressions/3845c252c6e9.json): a frozen embedding fed token ids is a
# unit no backward runs through; the frozen norm after it too, but the next unit's pre-backward
# prefetches that one. Its relatives: chains of such units, an int reshard_after_forward, the
# degenerate meshes, a tied (frozen) embedding with the root, the MLP's frozen first blocks.
_FROZEN_CHAIN = (
    "tok_embeddings.weight",
    "layers.0.attention_norm.weight",
    "layers.0.attention.wq.weight",
    "layers.0.attention.wk.weight",
)
_CHAIN_WRAP = ("layers.0.attention_norm", "layers.0.attention.wq", "layers.0.attention.wk", "layers.0", "")


def _no_backward_cases() -> dict[str, Case]:
    found = regression("3845c252c6e9")
    at4 = {"world_size": 4, "data.batch_size": 4}
    chain = {"model.frozen": _FROZEN_CHAIN, "wrap": _CHAIN_WRAP, "model.seq_len": 2}
    frozen_blocks = ("layers.0.linear.weight", "layers.0.linear.bias", "layers.1.linear.weight", "layers.1.linear.bias")
    return {
        "fuzz-frozen-embedding-then-norm": found,
        "reshard-to-2-of-4": found.with_(**at4, reshard_after_forward=2),
        "reshard-to-2-on-1x4": found.with_(**at4, mesh_shape=(1, 4), reshard_after_forward=2),
        "2-microbatches-on-1x2": found.with_(mesh_shape=(1, 2), microbatches=2, **{"data.batch_size": 4}),
        "frozen-chain": found.with_(**chain),
        "frozen-chain-tied-in-the-root": found.with_(**chain, **{"model.tie_embeddings": True}),
        "mlp-frozen-blocks": mlp_case(2, steps=1, wrap=("layers.0", "layers.1", "")).with_(
            **{"model.frozen": frozen_blocks}
        ),
        # unfrozen at step 2: its own backward runs from then on (`unfrozen_at`; issue 37's hunt)
        "unfrozen-at-step-2": found.with_(steps=2, unfreeze_step=2),
        # a checkpointed layers.0's recompute runs its frozen nested units' forwards in backward:
        # gathered there, and held under reshard_after_backward_last (`recomputed_in_backward`)
        "frozen-chain-recomputed": found.with_(**chain, activation_checkpointing=True),
        "frozen-chain-recomputed-held-k2-of-4": found.with_(
            **chain,
            **{**at4, "data.batch_size": 8},
            activation_checkpointing=True,
            reshard_after_forward=2,
            microbatches=2,
            reshard_after_backward_last=True,
        ),
        "fuzz-recomputed-norm-held-then-resumed": regression("706b29181f1a"),
    }


@pytest.mark.parametrize("name", sorted(_no_backward_cases()))
def test_a_unit_no_backward_runs_through_is_not_gathered_again(name):
    verdict = check_case(_no_backward_cases()[name])
    assert verdict.ok, verdict.summary()
    assert {f.comparator: f.kind for f in contract_findings(verdict)}["CommContract"] == "check"


@pytest.mark.parametrize("case_hash", ["3845c252c6e9", "706b29181f1a"], ids=["plain", "recomputed-and-held"])
def test_a_backward_gather_of_a_unit_no_backward_runs_through_is_caught(case_hash):
    """The root prefetching every unit in backward, the frozen embedding included: the gradients
    are FSDP2's, an all-gather too many is the contract's alone (also where a checkpointed
    recompute gathers the frozen norm in backward and reshard_after_backward_last holds it)."""
    case = regression(case_hash).with_(engine="tests/engines/comm_faults.py:gathers_every_unit_in_backward")
    verdict = check_case(case)
    failing = [f for f in verdict.findings if not f.ok]
    assert {f.comparator for f in failing} == {"CommContract"}, verdict.summary()
    assert any("backward: unexpected all_gather fp32 of 16 B over 2 ranks" in f.message for f in failing)


def test_sharding_over_the_replicas_is_caught_on_a_degenerate_mesh():
    """The mesh flattened: all-gathers and reduce-scatters where (2, 1) replicates (an all-reduce
    over 2)."""
    case = mlp_case(2, mesh_shape=(2, 1), steps=1, engine="tests/engines/comm_faults.py:shards_over_the_replicas")
    failing = [f for f in check_case(case).findings if not f.ok and f.comparator == "CommContract"]
    assert any("unexpected all_gather" in f.message for f in failing), [f.message for f in failing]


def test_one_replica_flattened_is_the_same_training_and_passes():
    """On (1, 2) the flattened mesh shards over the same two ranks: all it leaves out is FSDP2's
    all-reduce over the one-rank replica group, which moves nothing (torchtitan builds every
    one-replica case this way), so the contract holds it optional and the run is equivalent."""
    case = mlp_case(2, mesh_shape=(1, 2), steps=1, engine="tests/engines/comm_faults.py:shards_over_the_replicas")
    verdict = check_case(case)
    assert verdict.ok, verdict.summary()
    assert "CommContract" in {f.comparator for f in verdict.findings}


# ---- across a resume (issue 37) ---------------------------------------------------------------------
# A resumed run's first step is k + 1: the probe's facts (which units no backward runs through, the
# post-forward order) were read at step 1 and the model expected collectives from step 1, so a
# frozen unit's gather under reshard_after_backward_last was "unexpected"
# (tests/regressions/4231ec932989.json, every number equal). Its relatives: an int reshard (comm and
# memory), HSDP meshes either side, frozen parameters in the root, a frozen chain, the memory
# contract's post-forward shards, an unfreeze after the save.
_FROZEN_FIRST = {"model.frozen": ("layers.0.linear.weight", "layers.0.linear.bias")}
_HELD = dict(steps=2, microbatches=2, reshard_after_backward_last=True, resume_after=1)


def _resumed_cases() -> dict[str, tuple[Case, bool]]:
    """name -> (case, slow)."""
    chain = regression("3845c252c6e9").with_(steps=2, resume_after=1)
    first = ("layers.0", "")
    return {
        "issue-1-to-2": (regression("4231ec932989"), False),
        "int-reshard-2-of-4": (
            mlp_case(4, reshard_after_forward=2, wrap=("layers.0", "layers.1", ""), **_HELD).with_(**_FROZEN_FIRST),
            False,
        ),
        "1d-to-hsdp-2x2": (mlp_case(2, wrap=first, resume_mesh_shape=(2, 2), **_HELD).with_(**_FROZEN_FIRST), False),
        "hsdp-2x1-to-1x2": (
            mlp_case(2, wrap=first, mesh_shape=(2, 1), resume_mesh_shape=(1, 2), **_HELD).with_(**_FROZEN_FIRST),
            True,
        ),
        "frozen-in-the-root": (mlp_case(2, wrap=("layers.1", ""), **_HELD).with_(**_FROZEN_FIRST), True),
        "frozen-embedding-then-norm": (
            chain.with_(microbatches=2, reshard_after_backward_last=True, **{"data.batch_size": 4}),
            True,
        ),
        "memory-post-forward-shards": (regression("8608cf484d42").with_(steps=2, resume_after=1), False),
        "unfrozen-after-the-save": (chain.with_(steps=3, unfreeze_step=3), True),
        # a resume sweep's (seed 20263884): routed experts, frozen layers, replica_sync_last, (1, 2)
        "experts-frozen-layers-hsdp-1x2": (regression("c58e05bed64c"), True),
    }


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[pytest.mark.slow] if slow else []) for n, (_, slow) in _resumed_cases().items()]
)
def test_the_contracts_hold_across_a_resume(name, fsdp_check):
    case, _ = _resumed_cases()[name]
    verdict = fsdp_check(case, calibrate=False)
    assert verdict.ok, verdict.summary()
    assert {f.comparator: f.kind for f in contract_findings(verdict)} == {
        "CommContract": "check",
        "MemoryContract": "check",
    }


def test_a_resumed_run_records_its_first_steps_facts():
    """The probe's first step is the run's: a resumed run records the same boundaries and
    no-backward units at step k + 1 as the run that saved did at step 1."""
    from fsdp_verify.probes.memory import forward_facts
    from fsdp_verify.sharded.resume import run_resumed

    case = regression("3845c252c6e9").with_(steps=2, resume_after=1)
    saved, resumed, _ = run_resumed(case, timeout_s=120)
    assert forward_facts(resumed) == forward_facts(saved)
    assert forward_facts(saved)[1] == {"tok_embeddings", "layers.0.attention_norm"}  # the premise
    (record,) = resumed.meta["memory"]["ranks"][:1]
    assert record["first_step"] == 2 and {b[0] for b in record["boundaries"]} == {2}
    assert resumed.first_step == 2 and saved.first_step == 1


def test_a_comm_bug_after_a_resume_is_reported(fsdp_check):
    """An all-gather in fp32 under a bf16 policy, only in the resumed run: the model expected the
    steps the resumed run never ran, one finding per unit, phase and kind kept those (dropped
    after the resume as the saving run's), and the real ones at step 2 went unreported. The same
    case with the correct engine passes."""
    case = mlp_case(2, resume_after=1, precision=BF16)
    assert fsdp_check(case, calibrate=False).ok
    bad = fsdp_check(case.with_(resume_engine="fsdp_verify.zoo.mutants:all_gather_in_fp32"), calibrate=False)
    failing = [f for f in bad.findings if not f.ok]
    assert {(f.comparator, f.step) for f in failing} == {("CommContract", 2)}, bad.summary()
    assert any("all_gather fp32" in f.message and "the model says all_gather bf16" in f.message for f in failing)


# A fuzz false alarm (seed 20270206, dd9281d47026, shrunk to tests/regressions/64ef022a247b.json):
# routed experts behind a frozen block, their gate frozen, one expert of three trainable. Which
# units backward runs through is measured once, in the first micro-batch; here it follows each
# micro-batch's routing (rank 2's second routed nothing to the trainable expert, and FSDP2 issued
# no backward all-gather of the unit its prefetch names). Not modelled: both contracts skipped, why said.
def test_contracts_are_off_where_the_routing_decides_which_units_backward_runs_through(fsdp_check):
    case = regression("64ef022a247b")
    verdict = fsdp_check(case, calibrate=False)
    assert verdict.ok, verdict.summary()
    off = contract_findings(verdict)
    assert {(f.comparator, f.kind) for f in off} == {("CommContract", "skipped"), ("MemoryContract", "skipped")}
    assert all("depends on each micro-batch's routing" in f.message for f in off), [f.message for f in off]


@pytest.mark.parametrize(
    "trainable, decides",
    [
        ((), True),  # the regression: gate and first block frozen, one expert trainable
        (("moe.gate.weight",), False),  # a trainable gate: every micro-batch's output needs a gradient
        (("layers.0.linear.bias",), False),  # the experts' input needs a gradient
        (("moe.experts.2.bias", "moe.experts.0.weight"), True),  # still some frozen, some not
    ],
)
def test_the_routing_rule_fires_only_where_routing_decides(trainable, decides):
    from fsdp_verify.engines.contracts import routing_decides_backward

    case = regression("64ef022a247b")
    frozen = tuple(n for n in case.model.frozen if n not in trainable)
    assert (routing_decides_backward(case.with_(**{"model.frozen": frozen})) is not None) is decides


def test_contracts_hold_beside_routed_experts_with_a_trainable_gate(fsdp_check):
    """The rule's counterpart on the ranks: the same case with its gate trainable is held to the
    communication contract, before and after the resume (memory: off under checkpointing)."""
    case = regression("64ef022a247b")
    case = case.with_(**{"model.frozen": tuple(n for n in case.model.frozen if not n.startswith("moe.gate"))})
    verdict = fsdp_check(case, calibrate=False)
    assert verdict.ok, verdict.summary()
    kinds = [(f.comparator, f.kind) for f in contract_findings(verdict)]
    assert sorted(kinds) == [("CommContract", "check")] * 2 + [("MemoryContract", "skipped")] * 2, kinds
