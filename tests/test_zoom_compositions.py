"""Zoom beside tensor, expert and pipeline parallelism (docs/zoom.md, verify/zoom/): a correct
engine zoomed names nothing, and a zoo mutant of each composition is zoomed to the module (and the
tp rank, the expert and the rank holding it, or the stage) the bug is in."""

from __future__ import annotations

import pytest

from fsdp_verify.case import Case, ModelSpec
from fsdp_verify.case_specs import DataSpec, PrecisionSpec
from fsdp_verify.runner import check_case
from fsdp_verify.zoom.locate import zoom

TINY = ModelSpec(vocab_size=64, dim=16, n_heads=2, ffn_hidden=24, n_layers=1, seq_len=4)


def _mutant(name: str) -> str:
    return f"fsdp_verify.zoo.mutants:{name}"


def tp_case(world: int = 2, **changes) -> Case:
    base = {"model": TINY, "world_size": world, "tp": 2, "steps": 2, "data": DataSpec(batch_size=2 * world)}
    return Case(**{**base, **changes})


def moe_case(world: int = 2, ep: int = 2, microbatches: int = 1, **changes) -> Case:
    model = ModelSpec(kind="mlp", widths=(16, 33, 17, 8), experts=4, top_k=2)
    data = DataSpec(batch_size=world * microbatches * 3)
    return Case(model=model, world_size=world, ep=ep, microbatches=microbatches, data=data, steps=2, **changes)


def _passes_and_names_nothing(case: Case) -> None:
    verdict = check_case(case)
    assert verdict.ok, verdict.summary()
    result = zoom(case, verdict, step=case.steps)
    assert not result.named and result.modules, result.chain()
    assert all(row["ok"] for row in result.modules)


def _named(case: Case):
    verdict = check_case(case)
    assert not verdict.ok
    return zoom(case, verdict)


# ---- tensor parallelism ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "case",
    [
        tp_case(sequence_parallel=True, loss_parallel=True),
    ],
    ids=["transformer-sp-lp"],
)
def test_a_correct_tensor_parallel_run_zoomed_names_nothing(case):
    """Each tp rank's local values (DTensors as `to_local`, sequence shards, colwise chunks,
    rowwise partial sums before their reduction) against the reference's emulated locals."""
    _passes_and_names_nothing(case)


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [
        tp_case(4, sequence_parallel=True, precision=PrecisionSpec(param_dtype="bf16", reduce_dtype="bf16")),
        tp_case(4, microbatches=2, sync_every_microbatch=False, data=DataSpec(batch_size=16)),
        tp_case(sequence_parallel=True, model=ModelSpec(**{**TINY.__dict__, "dropout": 0.1})),
        Case(
            model=ModelSpec(kind="mlp", widths=(16, 32, 18, 8)),
            world_size=2,
            tp=2,
            steps=2,
            data=DataSpec(batch_size=4),
        ),
    ],
    ids=["mesh-2x2-sp-bf16", "mesh-2x2-microbatches", "sp-dropout", "mlp"],
)
def test_a_correct_tensor_parallel_run_zoomed_names_nothing_on_more_meshes(case):
    _passes_and_names_nothing(case)


def test_a_rowwise_output_never_all_reduced_is_zoomed_to_the_rowwise_linear():
    """The first rowwise linear (the attention's output projection) hands on its partial sum: its
    output parts while its inputs agree, and inside it the reduction the reference's emulation
    runs (its add) is an op only the reference ran."""
    result = _named(tp_case(engine=_mutant("rowwise_output_not_all_reduced")))
    assert (result.direction, result.module) == ("forward", "layers.0.attention.wo"), result.chain()
    assert (result.op, result.op_where) == ("aten.add.Tensor", "only on the reference side"), result.chain()
    assert result.place == f"tp rank {result.rank % 2} of data-parallel rank 0"
    assert "tp rank" in result.chain()


def test_a_vocab_sharded_embedding_without_its_mask_is_zoomed_to_the_embedding():
    result = _named(tp_case(engine=_mutant("embedding_tokens_not_masked")))
    assert (result.direction, result.module, result.op) == ("forward", "tok_embeddings", "aten.embedding.default")
    assert result.op_where == "parts", result.chain()


@pytest.mark.slow
def test_dropout_seeded_per_rank_is_zoomed_to_the_first_dropout():
    case = tp_case(engine=_mutant("dropout_seeded_per_rank"), model=ModelSpec(**{**TINY.__dict__, "dropout": 0.1}))
    result = _named(case)
    assert (result.module, result.op) == ("layers.0.attention.dropout", "aten.bernoulli_.float"), result.chain()


# ---- expert parallelism ------------------------------------------------------------------------------
def test_a_correct_expert_parallel_run_zoomed_names_nothing():
    """The experts' rows after the all-to-all (other ranks' tokens on the rank holding their
    expert) against the reference's rows of that expert from the rank that routed them."""
    _passes_and_names_nothing(moe_case())


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [
        moe_case(4, 2, microbatches=2, sync_every_microbatch=False),
        moe_case(4, 2, mesh_shape=(2, 2), precision=PrecisionSpec(param_dtype="bf16", reduce_dtype="fp32")),
        moe_case(4, 4),
        moe_case(2, 1),
    ],
    ids=["ep2-world4-microbatches", "ep2-hsdp-bf16", "ep4", "grouped-without-ep"],
)
def test_a_correct_expert_parallel_run_zoomed_names_nothing_on_more_meshes(case):
    _passes_and_names_nothing(case)


def test_tokens_combined_out_of_order_are_zoomed_to_the_expert_they_leave():
    """The rank holding experts 0 and 1 sends their outputs back expert by expert, not source by
    source: rank 0's first rows (expert 0's from rank 0) come back in place, the next are expert
    0's rows from rank 1, where rank 0's expert 1 rows belong. The experts module's output parts
    while the rows it received agree, first at expert 1 of rank 0, held by rank 0."""
    result = _named(moe_case(engine=_mutant("ep_tokens_combined_out_of_order")))
    assert (result.direction, result.module, result.rank, result.expert) == ("forward", "moe.experts", 0, 1)
    assert result.place == "expert 1, held by rank 0 (ep rank 0)", result.chain()
    assert result.op is None and "not compared under ep" in result.op_where


# ---- pipeline parallelism ----------------------------------------------------------------------------
def pp_case(world: int = 4, pp: int = 2, schedule: str = "1f1b", microbatches: int = 2, **changes) -> Case:
    changes.setdefault("model", ModelSpec(kind="mlp"))
    data = DataSpec(batch_size=(world // pp) * microbatches * 2)
    return Case(
        world_size=world,
        pp=pp,
        pp_schedule=schedule,
        microbatches=microbatches,
        sync_every_microbatch=False,
        steps=2,
        data=data,
        **changes,
    )


def test_a_correct_pipelined_run_zoomed_names_nothing():
    """Each stage's modules, micro-batch by micro-batch (the stage's forward and backward of one
    chunk open its pass), against the unsplit reference's."""
    _passes_and_names_nothing(pp_case())


@pytest.mark.slow
@pytest.mark.parametrize(
    "case",
    [
        pp_case(schedule="gpipe"),
        pp_case(schedule="interleaved1f1b", model=ModelSpec(kind="mlp", widths=(8, 16, 16, 16, 4))),
        pp_case(
            8,
            4,
            microbatches=4,
            model=TINY.__class__(**{**TINY.__dict__, "n_layers": 4, "tie_embeddings": True}),
            precision=PrecisionSpec(param_dtype="bf16", reduce_dtype="fp32"),
        ),
        pp_case(8, 2, mesh_shape=(2, 2)),
    ],
    ids=["gpipe", "interleaved", "transformer-4-stages-tied-bf16", "hsdp-in-stages"],
)
def test_a_correct_pipelined_run_zoomed_names_nothing_on_more_schedules(case):
    _passes_and_names_nothing(case)


def test_a_detached_stage_boundary_is_zoomed_to_the_boundary():
    """Stage 1 detaches its input: the gradient stage 0 receives parts first, at the output of
    its last module ('layers.1': the MLP's three blocks split 2 + 1)."""
    result = _named(pp_case(engine=_mutant("pp_stage_boundary_detached")))
    assert (result.direction, result.module, result.microbatch) == ("backward", "layers.1", 0), result.chain()
    assert "the boundary between stages 0 and 1" in result.why
    assert result.place == "stage 0, on rank 0 (data-parallel rank 0)"


def test_targets_reversed_on_the_last_stage_are_zoomed_to_its_loss():
    result = _named(pp_case(engine=_mutant("pp_microbatches_reversed_on_last_stage")))
    assert (result.direction, result.module) == ("backward", "layers.2"), result.chain()
    assert "the schedule's loss on the last stage (1)" in result.why
    assert result.place == "stage 1, on rank 2 (data-parallel rank 0)"


@pytest.mark.parametrize("mutant", ["pp_loss_not_divided_by_microbatches", "pp_stage_reduces_every_microbatch"])
def test_a_pipeline_mutant_in_the_reduction_is_not_given_a_module(mutant):
    """Gradients divided or reduced wrongly after the backward: every module's values agree, and
    the zoom must not invent a module (the verdict names the gradient)."""
    result = _named(pp_case(engine=_mutant(mutant)))
    assert not result.named and result.phase == "grads", result.chain()


def test_a_torch_whose_stages_cannot_be_hooked_refuses_a_zoom_beside_pp(monkeypatch):
    from fsdp_verify.engines import pipeline_parallel
    from fsdp_verify.validation import CaseError

    pp_case(zoom="1")  # this torch's stages can
    monkeypatch.setattr(pipeline_parallel, "stage_chunks", lambda: False)
    with pytest.raises(CaseError, match="zoom: expected None with pp=2 on this torch"):
        pp_case(zoom="1")
