"""Issue 39: FSDP2 composed with tensor and sequence parallelism (docs/tensor-parallel.md).

The case's fields and flags, their validation, and the capability they need (a plug-in engine that
declares nothing is never drawn tensor parallelism, and asking for it is bad input naming the
field and the declaration)."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings

from fsdp_verify.case import Case, ModelSpec
from fsdp_verify.case_specs import DataSpec, OptimSpec, PrecisionSpec
from fsdp_verify.commands.case_flags import case_to_flags
from fsdp_verify.properties.pins import PinError
from fsdp_verify.properties.strategies import cases
from fsdp_verify.runner import refuse_untakeable
from fsdp_verify.validation import CaseError
from tests.conftest import require
from tests.found import find
from tests.in_process import run_cli
from tests.ranks import spawn

PLAIN = "examples/engine/my_engine.py:shard"
TINY = ModelSpec(vocab_size=64, dim=16, n_heads=2, ffn_hidden=24, n_layers=1, seq_len=4)


def tp_case(**changes) -> Case:
    world = changes.get("world_size", 2)
    base = {"model": TINY, "world_size": 2, "tp": 2, "steps": 2, "data": DataSpec(batch_size=2 * world)}
    return Case(**{**base, **changes})


# ---- the case --------------------------------------------------------------------------------------
def test_the_world_counts_every_rank_and_the_mesh_is_the_data_parallel_part():
    case = tp_case(world_size=8, mesh_shape=(2, 2))
    assert (case.dp_size, case.mesh, case.device_mesh_shape, case.local_batch) == (4, (2, 2), (2, 2, 2), 4)
    assert tp_case(world_size=4).device_mesh_shape == (2, 2)
    assert Case().device_mesh_shape == (2,)  # no tp: the mesh as before


@pytest.mark.parametrize(
    "changes, field, expected",
    [
        ({"world_size": 3}, "world_size", "a multiple of tp=2"),
        ({"model": ModelSpec()}, "model.vocab_size", "tok_embeddings.num_embeddings = 61"),
        ({"model": TINY.__class__(**{**TINY.__dict__, "ffn_hidden": 25})}, "model.ffn_hidden", "w1.out_features"),
        ({"tp": 4, "world_size": 4}, "model.n_heads", "whole heads"),
        (
            {"sequence_parallel": True, "model": TINY.__class__(**{**TINY.__dict__, "seq_len": 5})},
            "model.seq_len",
            "splits the sequence",
        ),
        (
            {"model": TINY.__class__(**{**TINY.__dict__, "tie_embeddings": True})},
            "model.tie_embeddings",
            "cannot be both",
        ),
        ({"model": ModelSpec(kind="mlp", widths=(4, 5, 4))}, "model.widths", "layers.0.linear.out_features = 5"),
        ({"loss_parallel": True, "model": ModelSpec(kind="mlp", widths=(4, 6, 4))}, "loss_parallel", "MLP"),
        ({"tp": 1, "sequence_parallel": True}, "sequence_parallel", "false with tp=1"),
        ({"mesh_shape": (2, 2)}, "mesh_shape", "world_size=2 / tp=2 = 1"),
        ({"offload": True}, "offload", "not modelled"),
        ({"world_size": 8, "reshard_after_forward": 2}, "reshard_after_forward", "a hang"),
    ],
)
def test_a_case_tensor_parallelism_cannot_run_is_refused_naming_the_field(changes, field, expected):
    with pytest.raises(CaseError, match=expected) as info:
        tp_case(**changes)
    assert info.value.field_path == field


def test_a_model_without_a_plan_of_its_own_needs_one():
    from fsdp_verify.models.spec import ModelSpec as Spec

    spec = Spec(kind="custom", factory="tests/user/models.py:user_lm")
    with pytest.raises(CaseError, match="a plan for a model without one") as info:
        Case(model=spec, world_size=2, tp=2)
    assert info.value.field_path == "tp_plan"


@pytest.mark.parametrize(
    "case",
    [
        tp_case(world_size=8, mesh_shape=(2, 2), sequence_parallel=True, loss_parallel=True),
        tp_case(tp_plan="tests/user/tp_plans.py:TRANSFORMER"),
    ],
)
def test_a_tensor_parallel_case_is_its_flags(case):
    from fsdp_verify.commands.cli import build_parser
    from fsdp_verify.commands.options import case_from_args

    flags = case_to_flags(case)
    args = build_parser().parse_args(["check", *flags])
    assert case_from_args(args) == case, flags


# ---- who is drawn it ---------------------------------------------------------------------------------
@settings(max_examples=60, database=None, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=cases(world_sizes=(2, 4, 8), tp=[1, 2, 4], hsdp=True, precisions=("fp32", "bf16")))
def test_the_draw_gives_tensor_parallel_cases_fsdp2_takes(case):
    refuse_untakeable(case)  # every drawn case is one check takes
    p = case.precision
    if case.sequence_parallel:  # pytorch/pytorch#190626 is not drawn
        assert p.param_dtype in (None, "fp32") or p.reduce_dtype in (None, p.param_dtype)


@settings(max_examples=30, database=None, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=cases(world_sizes=(2,), tp=2, model_kinds=("transformer",), precisions=("bf16",), sequence_parallel=True))
def test_a_pinned_sequence_parallelism_draws_no_wider_reduce_unless_pinned_too(case):
    assert case.sequence_parallel and case.precision.reduce_dtype == "bf16"  # pytorch/pytorch#190626 not drawn


def test_tensor_parallel_degrees_are_drawn_only_where_asked():
    asked = cases(world_sizes=(2, 4), tp=[1, 2], hsdp=True, model_kinds=("transformer",), precisions=("fp32",))
    drawn = find(asked, lambda c: c.tp == 2 and c.sequence_parallel)
    assert drawn.dp_size * 2 == drawn.world_size
    assert find(cases(world_sizes=(2, 4)), lambda c: True).tp == 1


def test_a_plain_plugin_is_never_drawn_tensor_parallelism():
    with pytest.raises(PinError, match=r"tp: expected 1: engine .* does not declare `tp`"):
        cases(engine=PLAIN, tp=2)


def test_check_with_tp_on_a_plugin_that_declares_nothing_exits_2():
    run = run_cli(["check", "--engine", PLAIN, "--tp", "2", "--vocab-size", "64"])
    assert run.returncode == 2, run.stderr
    assert "tp: expected 1" in run.stderr and "Capabilities(takes=('tp', ...))" in run.stderr


# ---- correct runs: bit-exact ---------------------------------------------------------------------
def exact(verdict) -> None:
    """Every record equal to the bit (the reference emulates the ranks' arithmetic where the order
    is fixed: two tp ranks add commutatively), and the verdict passes."""
    assert verdict.ok, verdict.summary()
    inexact = [(f.key, f.max_ulp) for f in verdict.findings if f.phase != "param_sums" and f.max_abs != 0]
    assert not inexact, inexact


LLAMA = {"num_key_value_heads": 2, "vocab_size": 64}


def llama(kwargs: dict = LLAMA, **changes) -> Case:
    require("transformers")
    spec = ModelSpec(kind="custom", factory="fsdp_verify.models.hf:tiny_llama", kwargs=kwargs)
    return Case(model=spec, wrap=("LlamaDecoderLayer", ""), steps=2, data=DataSpec(batch_size=4), **changes)


BF16 = PrecisionSpec(param_dtype="bf16", reduce_dtype="bf16")


@pytest.mark.parametrize(
    "case",
    [
        tp_case(),
        tp_case(sequence_parallel=True, loss_parallel=True, precision=BF16, clip_norm=0.01),
        tp_case(sequence_parallel=True, model=TINY.__class__(**{**TINY.__dict__, "dropout": 0.1})),
        Case(
            model=ModelSpec(kind="mlp", widths=(16, 32, 18, 8), dropout=0.1),
            world_size=2,
            tp=2,
            microbatches=2,
            sync_every_microbatch=False,
            clip_norm=0.01,
            steps=2,
            data=DataSpec(batch_size=4),
        ),
        # Only a rowwise bias trains (replicated over tp): the clip's norms stay replicated over tp,
        # none divided by sqrt(tp) (a fresh-seed sweep's 4b03409051d9, 1 ulp otherwise).
        Case(
            model=ModelSpec(kind="mlp", widths=(23, 28, 9), frozen=("layers.0.linear", "layers.1.linear.weight")),
            world_size=2,
            tp=2,
            clip_norm=0.001,
            steps=2,
            data=DataSpec(batch_size=2, scale=100.0),
        ),
        # tp 4: the stacked norms all-reduced in gloo's order (a fresh-seed sweep's 64c33b71b948)
        Case(
            model=ModelSpec(kind="mlp", widths=(1, 40)),
            world_size=4,
            tp=4,
            clip_norm=0.0001,
            steps=2,
            data=DataSpec(batch_size=1, scale=0.01),
            data_seed=0,
        ),
        # A rowwise linear's input of one sample and one feature a rank: column-major by its local
        # strides, not by the DTensor's, and mm's backward picks its kernel by them (fresh-seed
        # sweep 20271101, case 468356afd158: 5 ulp in layer 0's gradient, 1.17x in Adam's state).
        Case(
            model=ModelSpec(kind="mlp", widths=(1, 2, 27, 6)),
            world_size=2,
            tp=2,
            steps=1,
            optim=OptimSpec(name="adamw", weight_decay=0.1, schedule="exponential"),
            data=DataSpec(batch_size=1),
            data_seed=1,
        ),
    ],
    ids=[
        "plain",
        "sp-lp-bf16-clip",
        "sp-dropout",
        "mlp-rowwise-bias",
        "clip-of-replicated-only",
        "clip-tp4",
        "rowwise-input-of-one-element",
    ],
)
def test_fsdp2_with_tensor_parallelism_is_bit_exact(fsdp_check, case):
    exact(fsdp_check(case, calibrate=False))


def test_a_transformers_model_with_its_own_plan_is_bit_exact(fsdp_check):
    exact(fsdp_check(llama(world_size=2, tp=2, loss_parallel=True), calibrate=False))


@pytest.mark.parametrize(
    "case",
    [
        tp_case(world_size=4, clip_norm=0.001, data=DataSpec(batch_size=8, scale=100.0), steps=3),
        tp_case(world_size=4, mesh_shape=(2, 1), clip_norm=0.001, precision=BF16, steps=3),
    ],
    ids=["w4", "hsdp2x1-bf16"],
)
def test_a_clip_beside_a_plan_that_leaves_norms_off_the_tp_mesh_is_bit_exact(fsdp_check, case):
    """Without sequence parallelism the Transformer's norms stay off the tp mesh, sharded over the
    data-parallel mesh alone: torch's `clip_grad_norm_` cannot stack the two meshes' norms (the
    case refused a clip there), the view clips the two groups as torchtitan clips beside ep, and
    the reference takes each group's norm so (`TensorParallel.norm`); the communication contract
    holds the two groups' all-reduces. Its mutant clips by the tp mesh's norm alone."""
    verdict = fsdp_check(case, calibrate=False)
    exact(verdict)
    assert "CommContract" in {f.comparator for f in verdict.findings if f.kind == "check"}
    mutant = fsdp_check(case.with_(engine="fsdp_verify.zoo.mutants:clip_norm_of_one_mesh"), calibrate=False)
    assert not mutant.ok and mutant.first_divergence.phase == "grad_norm", mutant.summary()


def test_fsdp2_summing_sequence_parallel_norm_gradients_in_bf16_is_caught(fsdp_check):
    """pytorch/pytorch#190626 (tests/upstream/test_fsdp2_tp_reduce_dtype.py): the norms' partial
    gradients summed over tp in param_dtype, bf16, while reduce_dtype is fp32. Only they part."""
    precision = PrecisionSpec(param_dtype="bf16", reduce_dtype="fp32")
    verdict = fsdp_check(tp_case(sequence_parallel=True, precision=precision, steps=1), calibrate=False)
    first = verdict.first_divergence
    assert not verdict.ok and (first.step, first.phase) == (1, "grads"), verdict.summary()
    parted = {f.name for f in verdict.findings if f.phase == "grads" and f.max_abs != 0}
    assert parted and all(n.endswith("norm.weight") for n in parted), parted
    assert "pytorch/pytorch#190626" in verdict.hint and first.name in verdict.hint, verdict.hint


@pytest.mark.parametrize(
    "changes, name",
    [
        ({"precision": PrecisionSpec()}, "layers.0.attention_norm.weight"),  # fp32: no ingredient
        ({"precision": PrecisionSpec(param_dtype="bf16", reduce_dtype="bf16")}, "layers.0.attention_norm.weight"),
        ({"sequence_parallel": False}, "layers.0.attention_norm.weight"),  # no sum over tp
        ({}, "layers.0.attention.wq.weight"),  # a colwise weight: not the gradient the bug sums
    ],
    ids=["fp32", "bf16-reduction", "no-sp", "not-a-norm"],
)
def test_the_190626_hint_needs_every_ingredient_and_the_norm_parting_first(changes, name):
    from fsdp_verify.compare.finding import Finding
    from fsdp_verify.engines.tensor_parallel import reduce_dtype_hint

    base = {"sequence_parallel": True, "precision": PrecisionSpec(param_dtype="bf16", reduce_dtype="fp32")}
    first = Finding(1, "grads", name, False, "deviation", "GradsComparator")
    assert reduce_dtype_hint(tp_case(**{**base, **changes}), first) == ""
    assert "#190626" in reduce_dtype_hint(tp_case(**base), replace(first, name="layers.0.attention_norm.weight"))


def test_sequence_parallel_training_a_frozen_norm_is_caught(fsdp_check):
    """torch 2.13's SequenceParallel makes a frozen parameter trainable
    (tests/upstream/test_sequence_parallel_unfreezes_params.py): the frozen norm gets a gradient
    the reference's does not have, at step 1."""
    model = TINY.__class__(**{**TINY.__dict__, "frozen": ("layers.0.attention_norm.weight",)})
    verdict = fsdp_check(tp_case(sequence_parallel=True, model=model, steps=1), calibrate=False)
    first = verdict.first_divergence
    assert not verdict.ok and (first.step, first.phase, first.name) == (
        1,
        "grads",
        "layers.0.attention_norm.weight",
    ), verdict.summary()


def test_colwise_shards_start_where_the_ranks_do(fsdp_check):
    """The reference's shards are fresh tensors, as the ranks' are: a (1, 7) input through a
    colwise shard viewed at row 6 of a 7-wide weight took another BLAS path (1 ulp, a sweep's)."""
    case = Case(
        model=ModelSpec(kind="mlp", widths=(1, 2, 7, 12)),
        world_size=4,
        mesh_shape=(1, 2),
        tp=2,
        steps=1,
        data=DataSpec(batch_size=2, kind="cancellation", scale=0.01),
    )
    exact(fsdp_check(case, calibrate=False))


MESHES = [(2, None), (4, None), (4, (1, 2)), (8, (2, 2))]


@pytest.mark.slow
@pytest.mark.parametrize("world, mesh", MESHES, ids=["1x2", "2x2", "(1,2)x2", "(2,2)x2"])
@pytest.mark.parametrize("precision", [PrecisionSpec(), BF16, PrecisionSpec(param_dtype="bf16", reduce_dtype="fp32")])
@pytest.mark.parametrize(
    "styles", [{}, {"sequence_parallel": True}, {"sequence_parallel": True, "loss_parallel": True}]
)
def test_the_transformer_on_every_mesh(fsdp_check, world, mesh, precision, styles):
    if styles.get("sequence_parallel") and precision.reduce_dtype == "fp32":
        pytest.skip("pytorch/pytorch#190626: test_fsdp2_summing_sequence_parallel_norm_gradients_in_bf16_is_caught")
    exact(fsdp_check(tp_case(world_size=world, mesh_shape=mesh, precision=precision, **styles), calibrate=False))


@pytest.mark.slow
@pytest.mark.parametrize("world, tp", [(2, 2), (4, 2), (4, 4)], ids=["1x2", "2x2", "1x4"])
@pytest.mark.parametrize("precision", [PrecisionSpec(), BF16])
def test_tiny_llama_on_every_mesh(fsdp_check, world, tp, precision):
    kwargs = {"num_key_value_heads": 4, "num_attention_heads": 4, "vocab_size": 64} if tp == 4 else LLAMA
    exact(fsdp_check(llama(kwargs, world_size=world, tp=tp, loss_parallel=True, precision=precision), calibrate=False))


@pytest.mark.slow
def test_tiny_llama_on_a_3d_mesh(fsdp_check):
    exact(fsdp_check(llama(world_size=8, mesh_shape=(2, 2), tp=2, precision=BF16), calibrate=False))


# ---- the Recorder on a tensor-parallel run ---------------------------------------------------------
def _recorded_rank(rank: int, world: int, rendezvous: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fsdp_verify.engines.tensor_parallel import apply_plan, transformer_plan
    from fsdp_verify.models import build_model
    from fsdp_verify.recorder import Recorder

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    model = build_model(TINY, 0)
    apply_plan(model, mesh["tp"], transformer_plan(model, sequence_parallel=True, loss_parallel=False))
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rec = Recorder(model, optimizer, out=out, full_steps=[1])
    tokens = torch.randint(0, TINY.vocab_size, (2, TINY.seq_len + 1), generator=torch.Generator().manual_seed(0))
    logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    optimizer.step()
    rec.step(loss=loss, logits=logits, batch=(tokens[:, :-1], tokens[:, 1:]))
    rec.close()
    dist.barrier()
    os._exit(0)


def test_the_recorder_records_a_tensor_parallel_runs_2d_shards_whole(tmp_path):
    """A colwise weight is `_StridedShard` rows over the data-parallel dims and Shard(0) over tp, a
    rowwise one Shard(1): no block of rows a rank holds. The Recorder gathers them whole (its only
    collective) where it records a plain FSDP2 shard's rows."""

    from fsdp_verify.recorder.store import Run

    out = tmp_path / "run"
    spawn(_recorded_rank, args=(2, str(tmp_path / "rendezvous"), str(out)), nprocs=2)
    run = Run(out, "tp")
    for rank in range(2):
        tensors, header = run.load(rank, 1)
        layout = {entry[0]: entry for entry in header["opt1/params"]}
        wq, wo = layout["layers.0.attention.wq.weight"], layout["layers.0.attention.wo.weight"]
        assert wq[1:4] == [16, 0, 16] and wo[1:4] == [16, 0, 16], (wq, wo)  # every row, from row 0
        assert tensors["full/opt1/params/layers.0.attention.wo.weight"].shape == (16, 16)


def test_a_pointwise_op_of_dtensors_of_one_layout_stays_one_in_the_reference():
    """The reference's `Ranks` follows DTensor where a plan keeps activations DTensors (torchtitan's):
    a residual add of two sequence shards is a sequence shard (the next SequenceParallel takes it
    with no `from_local` node, so its input gradients meet as on the ranks); a local operand, or an
    op that is not pointwise, leaves a local tensor."""
    import torch

    from fsdp_verify.reference.tensor_parallel import Ranks

    def shard(placement=("shard", 1)):
        return Ranks([torch.ones(2, 3), torch.ones(2, 3)], placement)

    assert (shard() + shard()).placement == ("shard", 1)
    assert (shard() * 2.0).placement == ("shard", 1)
    assert (2.0 ** shard()).placement == ("shard", 1)  # a scalar first: aten.pow.Scalar
    assert (shard() + Ranks([torch.ones(2, 3)] * 2)).placement is None
    assert (shard() + shard(("replicate",))).placement is None
    assert shard().sum(-1).placement is None
