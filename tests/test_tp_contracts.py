"""Issue 39: the communication and memory contracts beside tensor parallelism (docs/contracts.md,
verify/checks/tp_comm.py). A correct FSDP2+TP run issues exactly the collectives its plan
implies over the tp group, each layer's, beside FSDP2's over the data-parallel dims, and holds
exactly a tp rank's shares sharded over dp; a collective in the wrong dtype, a missing one and an
extra one are named with the layer, a kept replica with the boundary. A user's plan leaves the
tp part of the comm contract n/a."""

from __future__ import annotations

import pytest

from fsdp_verify.case import Case, ModelSpec
from fsdp_verify.case_specs import DataSpec, PrecisionSpec
from fsdp_verify.checks.comm import check_comm, expected_collectives, measured_collectives
from fsdp_verify.checks.memory import check_memory
from fsdp_verify.engines.contracts import case_contracts
from fsdp_verify.probes.comm import mesh_dim_of
from fsdp_verify.sharded.pool import get_pool
from tests.conftest import require

TINY = ModelSpec(vocab_size=64, dim=16, n_heads=2, ffn_hidden=24, n_layers=1, seq_len=4)
BF16 = PrecisionSpec(param_dtype="bf16", reduce_dtype="bf16")
MUTANTS = "fsdp_verify.zoo.mutants"


def tp_case(world_size: int = 2, **changes) -> Case:
    base = {"model": TINY, "world_size": world_size, "tp": 2, "steps": 1, "data": DataSpec(batch_size=2 * world_size)}
    return Case(**{**base, **changes})


def run(case: Case):
    """The sharded side's trace and the comm contract's findings on it."""
    got = get_pool(case.world_size).run(case, 300)
    return got, check_comm(case, None, got)


def over_tp(collectives) -> list:
    return [c for c in collectives if c.over == "tp"]


def test_a_group_is_named_by_the_mesh_dim_it_spans():
    shape, names = (2, 2, 2), ("replicate", "shard", "tp")
    assert mesh_dim_of([4, 5], shape, names) == "tp"
    assert mesh_dim_of([5, 7], shape, names) == "shard"
    assert mesh_dim_of([7, 3], shape, names) == "replicate"
    assert mesh_dim_of([0, 3], shape, names) == ""  # no one dim's group
    assert mesh_dim_of(list(range(8)), shape, names) == ""


def test_a_tp_layer_issues_exactly_the_hand_computed_collectives():
    """(1, 2), fp32, the built-in Transformer's plan: a micro-batch of 4 samples x 4 tokens, so an
    activation of width 16 is 16 x 16 x 4 = 1,024 B and the logits 16 x 64 x 4 = 4,096 B. Forward:
    the vocabulary-sharded embedding's, wo's and w2's partial sums all-reduced, the head's output
    gathered; backward: the input gradient of each of the six colwise linears all-reduced. No
    FSDP2 collective over a shard group of one."""
    case = tp_case()
    got, findings = run(case)
    assert findings == []
    want = [("forward", "all_reduce", 1024, u) for u in ("tok_embeddings", "layers.0.attention.wo")]
    want += [("forward", "all_reduce", 1024, "layers.0.feed_forward.w2"), ("forward", "all_gather", 4096, "output")]
    colwise = ["output"] + [f"layers.0.attention.{w}" for w in ("wq", "wk", "wv")]
    colwise += [f"layers.0.feed_forward.{w}" for w in ("w1", "w3")]
    want += [("backward", "all_reduce", 1024, u) for u in colwise]
    expected = expected_collectives(case, got)
    assert sorted((c.phase, c.kind, c.bytes, c.unit) for c in expected) == sorted(want)
    assert all((c.group, c.over, c.dtype) == (2, "tp", "fp32") for c in expected)
    for rank in measured_collectives(got):
        assert sorted((c.phase, c.kind, c.bytes, c.over) for c in rank) == sorted(
            (p, k, b, "tp") for p, k, b, _ in want
        )


@pytest.mark.parametrize("world", [2, 4], ids=["1x2", "2x2"])
@pytest.mark.parametrize(
    "styles",
    [{}, {"sequence_parallel": True}, {"sequence_parallel": True, "loss_parallel": True}],
    ids=["plain", "sp", "sp-lp"],
)
def test_the_correct_engine_meets_the_comm_contract_beside_tp(world, styles):
    clip = 1.0 if styles else None  # the plain plan leaves the norms off the tp mesh: no clip (the Case refuses it)
    case = tp_case(world, precision=BF16 if world == 4 else PrecisionSpec(), clip_norm=clip, **styles)
    got, findings = run(case)
    assert findings == [], [f.message for f in findings]
    expected = expected_collectives(case, got)
    assert over_tp(expected)  # tp's own collectives held, not skipped
    assert any(c.over == "shard" for c in expected) == (world == 4)  # FSDP2's beside them, over (2, 2)
    if styles.get("sequence_parallel"):  # the norms' partial gradients summed over tp
        assert {c.unit for c in expected if c.unit.endswith("norm.weight")} == {
            "norm.weight",
            "layers.0.attention_norm.weight",
            "layers.0.ffn_norm.weight",
        }
    assert case_contracts(case).comm and case_contracts(case).memory
    assert check_memory(case, None, got) == []


@pytest.mark.parametrize(
    "case",
    [
        tp_case(4, model=TINY.__class__(**{**TINY.__dict__, "frozen": ("tok_embeddings",)}), sequence_parallel=True),
        tp_case(4, sequence_parallel=True, microbatches=2, sync_every_microbatch=False, data=DataSpec(batch_size=8)),
        tp_case(4, sequence_parallel=True, loss_parallel=True, activation_checkpointing=True),
        Case(model=ModelSpec(kind="mlp", widths=(16, 32, 18, 8)), world_size=2, tp=2, clip_norm=0.01, steps=1),
        # a (1, 1) data-parallel mesh: FSDP2's all-reduce over one replica, its group of one rank
        # every size-1 dim's (a fresh-seed sweep's false alarm, seed 20271501, add92a7702c9)
        tp_case(2, mesh_shape=(1, 1)),
        # unfrozen at step 2: the embedding's output needs a gradient from then on (its backward
        # all-gather under SP, "unexpected" when the layers were traced frozen at every step)
        tp_case(
            2,
            model=TINY.__class__(**{**TINY.__dict__, "frozen": ("tok_embeddings",)}),
            sequence_parallel=True,
            unfreeze_step=2,
            steps=2,
        ),
    ],
    ids=["frozen-embedding-sp", "no-sync-sp", "checkpointed-sp-lp", "mlp-clip", "mesh-1x1", "unfrozen-at-2-sp"],
)
def test_the_contract_follows_what_needs_a_gradient_and_when_it_syncs(case):
    """A frozen embedding under SP: its output needs no gradient, so no backward all-gather; the
    norms' sums only on the synced micro-batch; a checkpointed block's recompute re-issues its
    forward collectives in backward; the MLP's first colwise input (the data) has no gradient."""
    got, findings = run(case)
    assert findings == [], [f.message for f in findings]
    assert over_tp(expected_collectives(case, got))
    assert check_memory(case, None, got) == []  # n/a under checkpointing (as without tp)


def test_a_tp_collective_carries_the_dtype_that_reaches_it():
    """Issue 48, tests/regressions/901b93e0a196.json (an MLP at (1, 2), bf16 parameters, output
    fp32): `layers.2.linear` sits in the root unit and takes the unit `layers.1`'s output, cast
    to fp32 by FSDP2, so its colwise input's gradient is all-reduced in fp32 (4 B), not in
    param_dtype as the model said; the rowwise partial sum of `layers.1.linear` inside its unit
    is in its compute dtype, bf16, and so is the gathered output."""
    from tests.conftest import regression

    case = regression("901b93e0a196")
    got, findings = run(case)
    assert findings == [], [f.message for f in findings]
    assert sorted((c.unit, c.phase, c.kind, c.dtype, c.bytes) for c in over_tp(expected_collectives(case, got))) == [
        ("layers.1.linear", "forward", "all_reduce", "bf16", 2),
        ("layers.2.linear", "backward", "all_reduce", "fp32", 4),
        ("layers.2.linear", "forward", "all_gather", "bf16", 4),
    ]


@pytest.mark.parametrize("output_dtype", [None, "fp32", "bf16"])
@pytest.mark.parametrize("cast_inputs", [True, False])
@pytest.mark.parametrize(
    "kind, wrap",
    [
        ("mlp", ("layers.0", "layers.1", "")),
        ("mlp", ("layers.1", "layers.2", "")),
        ("transformer", ("layers.0.attention", "layers.0.feed_forward", "layers.0", "")),
    ],
    ids=["mlp-01", "mlp-12", "lm"],
)
def test_the_tp_dtypes_follow_the_casts_of_the_units_around_each_layer(kind, wrap, output_dtype, cast_inputs):
    """The correct engine beside tp under bf16 parameters with every output dtype and input cast
    FSDP2 takes, the units placed so that layers sit inside and outside them: each collective is
    expected in the dtype the traced forward gives it (none fails)."""
    # SP's norm gradients with an fp32 reduce_dtype meet pytorch/pytorch#190626 (not drawn): bf16 there
    reduce = "fp32" if kind == "mlp" else "bf16"
    precision = PrecisionSpec(
        param_dtype="bf16", reduce_dtype=reduce, output_dtype=output_dtype, cast_forward_inputs=cast_inputs
    )
    model = ModelSpec(kind="mlp", widths=(8, 16, 12, 8)) if kind == "mlp" else TINY
    styles = {"sequence_parallel": True} if kind == "transformer" else {}
    case = tp_case(model=model, wrap=wrap, precision=precision, **styles)
    got, findings = run(case)
    assert findings == [], [f.message for f in findings]


# ---- what the contract catches ---------------------------------------------------------------------
def test_the_tp_all_reduce_in_bf16_under_an_fp32_reduce_dtype_is_named_with_its_dtype():
    """The zoo's `tp_grad_all_reduce_in_bf16`: each norm's partial gradient summed over tp in bf16."""
    precision = PrecisionSpec(param_dtype="bf16", reduce_dtype="fp32")
    case = tp_case(sequence_parallel=True, precision=precision, engine=f"{MUTANTS}:tp_grad_all_reduce_in_bf16")
    _, findings = run(case)
    assert {f.name for f in findings} == {
        f"{n}:backward:all_reduce"
        for n in ("norm.weight", "layers.0.attention_norm.weight", "layers.0.ffn_norm.weight")
    }
    for f in findings:
        assert "all_reduce bf16 of 32 B over 2 ranks (tp), the model says all_reduce fp32 of 64 B" in f.message


def test_fsdp2s_own_bf16_sum_of_the_norm_gradients_is_named_too():
    """pytorch/pytorch#190626 (torch 2.13, not drawn): FSDP2 sums the norms' partial gradients over
    tp in param_dtype. The numbers part at the gradients; the contract names the dtype."""
    case = tp_case(sequence_parallel=True, precision=PrecisionSpec(param_dtype="bf16", reduce_dtype="fp32"))
    _, findings = run(case)
    assert findings and all("bf16" in f.message and "the model says all_reduce fp32" in f.message for f in findings)


@pytest.mark.parametrize(
    "case, layers",
    [
        (tp_case(4), {"layers.0.attention.wo", "layers.0.feed_forward.w2"}),
        (Case(model=ModelSpec(kind="mlp", widths=(16, 32, 18, 8)), world_size=2, tp=2, steps=1), {"layers.1.linear"}),
    ],
    ids=["transformer-2x2", "mlp-1x2"],
)
def test_a_rowwise_output_never_all_reduced_is_named_with_its_layer(case, layers):
    _, findings = run(case.with_(engine=f"{MUTANTS}:rowwise_output_not_all_reduced"))
    assert {f.name for f in findings} == {f"{u}:forward:all_reduce" for u in layers}
    assert all("none issued" in f.message and "(tp)" in f.message for f in findings)


def test_a_norm_gradient_never_summed_over_tp_is_named_with_its_weight():
    _, findings = run(tp_case(sequence_parallel=True, engine=f"{MUTANTS}:tp_norm_grad_not_reduced"))
    assert {f.name for f in findings} == {
        f"{n}:backward:all_reduce"
        for n in ("norm.weight", "layers.0.attention_norm.weight", "layers.0.ffn_norm.weight")
    }


def test_an_extra_gather_per_linear_is_named_with_the_layers_it_could_belong_to():
    """tests/engines/comm_faults.py: the feed-forward's w1 and w3 each gather the sequence (twice the
    traffic of its PrepareModuleInput's one gather): one all-gather forward and one reduce-scatter
    backward more than the plan says, the feed-forward among the layers named."""
    engine = "tests/engines/comm_faults.py:gathers_the_sequence_per_linear"
    _, findings = run(tp_case(4, sequence_parallel=True, engine=engine))
    assert {(f.name.split(":")[1], f.name.split(":")[2]) for f in findings} == {
        ("forward", "all_gather"),
        ("backward", "reduce_scatter"),
    }
    assert all("one more than the model says" in f.message and "'layers.0.feed_forward'" in f.message for f in findings)


def test_a_replica_kept_beside_tp_is_caught_by_the_memory_contract():
    """The zoo's `retains_full_params` on a (2, 2) mesh: the original parameters, kept in a list
    before the plan and the sharding, are whole (global shapes) on every rank."""
    case = tp_case(4, steps=1, engine=f"{MUTANTS}:retains_full_params")
    got = get_pool(case.world_size).run(case, 300)
    findings = check_memory(case, None, got)
    assert findings and all(f.name == "unsharded:before forward" for f in findings)
    assert "17,088 B of unsharded parameters alive" in findings[0].message  # the whole fp32 model


def test_unsharded_tp_shares_are_counted_while_a_unit_computes():
    """reshard_after_forward=False on (2, 2): after each forward both units' tp-local parameters
    are unsharded DTensors, counted (8,640 B: 4,480 + 4,160, tp-local shapes padded over dp)."""
    case = tp_case(4, reshard_after_forward=False)
    got = get_pool(case.world_size).run(case, 300)
    assert check_memory(case, None, got) == []
    after = [b for b in got.meta["memory"]["ranks"][0]["boundaries"] if b[2].startswith("after forward")]
    assert after and all(b[3] == 8640 for b in after)


# ---- what is not derived --------------------------------------------------------------------------
def test_a_users_plan_leaves_only_the_tp_part_na(capsys):
    """A user's plan may bring styles of its own: its collectives over tp are measured, not held;
    FSDP2's over the data-parallel dims still are."""
    from fsdp_verify.commands.cli import main

    case = tp_case(4, tp_plan="tests/user/tp_plans.py:TRANSFORMER")
    got, findings = run(case)
    assert findings == []
    expected = expected_collectives(case, got)
    assert expected and not over_tp(expected) and all(c.over == "shard" for c in expected)
    assert over_tp(measured_collectives(got)[0])  # issued all the same: measured only
    flags = ["comm", "--tp", "2", "--world-size", "4", "--vocab-size", "64", "--steps", "1"]
    assert main([*flags, "--tp-plan", "tests/user/tp_plans.py:TRANSFORMER", "--trust-code"]) == 0
    out = capsys.readouterr().out
    assert "contract over tp: n/a (a user's tp plan" in out and "2 (tp)" in out


# ---- heavier matrices (nightly) ---------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize(
    "world, mesh, tp", [(2, None, 2), (4, None, 2), (4, None, 4), (8, (2, 2), 2)], ids=["1x2", "2x2", "1x4", "2x2x2"]
)
@pytest.mark.parametrize("precision", [PrecisionSpec(), BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "styles",
    [{}, {"sequence_parallel": True, "clip_norm": 1.0}, {"sequence_parallel": True, "loss_parallel": True}],
    ids=["plain", "sp-clip", "sp-lp"],
)
def test_the_comm_contract_on_every_mesh(world, mesh, tp, precision, styles):
    model = TINY.__class__(**{**TINY.__dict__, "n_heads": 4}) if tp == 4 else TINY
    case = tp_case(world, mesh_shape=mesh, tp=tp, model=model, precision=precision, steps=2, microbatches=2, **styles)
    got, findings = run(case)
    assert findings == [], [f.message for f in findings]
    assert over_tp(expected_collectives(case, got))
    assert check_memory(case, None, got) == []


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4], ids=["1x2", "2x2"])
def test_the_comm_contract_for_tiny_llama_with_its_own_plan(world):
    require("transformers")
    spec = ModelSpec(
        kind="custom", factory="fsdp_verify.models.hf:tiny_llama", kwargs={"num_key_value_heads": 2, "vocab_size": 64}
    )
    case = Case(
        model=spec,
        wrap=("LlamaDecoderLayer", ""),
        world_size=world,
        tp=2,
        loss_parallel=True,
        activation_checkpointing=True,
        precision=BF16,
        steps=2,
        data=DataSpec(batch_size=4),
    )
    got, findings = run(case)
    assert findings == [], [f.message for f in findings]
    assert {c.unit for c in over_tp(expected_collectives(case, got))} >= {"model.embed_tokens", "lm_head"}
