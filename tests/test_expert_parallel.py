"""Issue 40, expert parallelism (docs/expert-parallel.md): the grouped experts sharded over an ep
mesh dim with all-to-all dispatch, FSDP2 over the dense parameters and over what the ep dim leaves
for the experts, against a reference that computes every expert on one device (reference/
expert_parallel.py). Correct runs are bit-exact; each mutant is caught; ep is opt-in for a plug-in
engine; a declared ep the engine does not apply is named."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings

from fsdp_verify.case import Case
from fsdp_verify.case_specs import DataSpec, LossScaleSpec, PrecisionSpec
from fsdp_verify.commands.cli import main
from fsdp_verify.engines.contracts import case_contracts
from fsdp_verify.models import ModelSpec, build_model
from fsdp_verify.properties.draw import draw_cases
from fsdp_verify.properties.strategies import cases
from fsdp_verify.runner import refuse_untakeable
from fsdp_verify.validation import CaseError

PLAIN = "examples/engine/my_engine.py:shard"
EVERYTHING = "examples/engine/my_engine.py:shard_everything"
BF16 = PrecisionSpec(param_dtype="bf16", reduce_dtype="fp32")


def moe_case(world: int, ep: int, mesh=None, precision=None, microbatches: int = 1, **model) -> Case:
    spec = {"widths": (16, 33, 17, 8), "experts": 4, "top_k": 2, **model}
    return Case(
        model=ModelSpec(kind="mlp", **spec),
        world_size=world,
        mesh_shape=mesh,
        ep=ep,
        precision=precision or PrecisionSpec(),
        microbatches=microbatches,
        data=DataSpec(batch_size=world * microbatches * 3),
        steps=2,
    )


def _inexact(verdict) -> list:
    return [(f.key, f.max_abs) for f in verdict.findings if f.phase != "param_sums" and f.max_abs not in (0, None)]


# ---- correct runs: bit-exact -------------------------------------------------------------------------
CI_MATRIX = [
    pytest.param(2, 2, None, None, id="ep2-w2-fp32"),
    pytest.param(4, 2, (2, 2), BF16, id="ep2-hsdp2x2-bf16"),
]
NIGHTLY_MATRIX = [
    pytest.param(4, 2, None, None, id="ep2-w4-fp32"),
    pytest.param(4, 2, None, BF16, id="ep2-w4-bf16"),
    pytest.param(4, 4, None, None, id="ep4-w4-fp32"),
    pytest.param(4, 4, None, BF16, id="ep4-w4-bf16"),
    pytest.param(4, 2, (2, 2), None, id="ep2-hsdp2x2-fp32"),
    pytest.param(4, 4, (1, 4), BF16, id="ep4-hsdp1x4-bf16"),
    pytest.param(4, 4, (1, 4), None, id="ep4-hsdp1x4-fp32"),
    pytest.param(2, 2, None, BF16, id="ep2-w2-bf16"),
]


@pytest.mark.parametrize(("world", "ep", "mesh", "precision"), CI_MATRIX)
def test_correct_expert_parallelism_is_bit_exact(fsdp_check, world, ep, mesh, precision):
    verdict = fsdp_check(moe_case(world, ep, mesh, precision, microbatches=2), calibrate=False)
    assert verdict.ok, verdict.summary()
    assert not _inexact(verdict)


@pytest.mark.slow
@pytest.mark.parametrize(("world", "ep", "mesh", "precision"), NIGHTLY_MATRIX)
@pytest.mark.parametrize(
    "routing",
    [{}, {"capacity_factor": 0.5, "top_k": 1}, {"aux_loss": 0.1, "router_bias": 0.01}],
    ids=["dropless-top2", "capacity-top1", "aux-bias"],
)
def test_correct_expert_parallelism_is_bit_exact_everywhere(fsdp_check, world, ep, mesh, precision, routing):
    verdict = fsdp_check(moe_case(world, ep, mesh, precision, microbatches=2, **routing), calibrate=False)
    assert verdict.ok, verdict.summary()
    assert not _inexact(verdict)


def test_dropped_tokens_routing_loss_and_bias_beside_ep_are_bit_exact(fsdp_check):
    case = moe_case(4, 2, (2, 2), BF16, microbatches=2, capacity_factor=0.5, aux_loss=0.1, router_bias=0.01)
    verdict = fsdp_check(case.with_(replica_sync_last=True), calibrate=False)
    assert verdict.ok, verdict.summary()
    assert not _inexact(verdict)


@pytest.mark.parametrize(
    ("world", "ep", "mesh", "precision"),
    [
        pytest.param(2, 2, None, None, id="ep2-w2-fp32"),
        pytest.param(4, 2, None, BF16, id="ep2-w4-bf16"),
        pytest.param(4, 2, (2, 2), None, id="ep2-hsdp2x2-fp32"),
        pytest.param(4, 4, None, None, id="ep4-w4-fp32"),
    ],
)
def test_a_clip_beside_ep_is_bit_exact(fsdp_check, world, ep, mesh, precision):
    """The experts' gradients on ("efsdp", "ep"), the dense ones on the data-parallel mesh: each
    mesh's norm whole, the total the root of their squares' sum, as torchtitan clips
    (`EngineView.clip_grad_norm_`); the reference reduces each expert's norm over "efsdp", then
    "ep", as DTensor does (reference/expert_parallel.py `ep_norm`). A clip small enough that every
    step clips (the norm is recorded and every gradient scaled by it)."""
    case = moe_case(world, ep, mesh, precision, microbatches=2).with_(clip_norm=0.01, steps=3)
    verdict = fsdp_check(case, calibrate=False)
    assert verdict.ok, verdict.summary()
    assert not _inexact(verdict)
    norms = [f for f in verdict.findings if f.phase == "grad_norm"]
    assert len(norms) == 3, norms


def test_the_aux_loss_all_reduce_is_in_the_comm_contract(fsdp_check):
    """Without ep the contracts hold: the forward's all-reduce of the counts is modelled."""
    verdict = fsdp_check(moe_case(2, 1, microbatches=2, aux_loss=0.1, router_bias=0.01))
    assert verdict.ok, verdict.summary()
    assert {"comm", "memory"} <= {f.phase for f in verdict.findings}


def test_contracts_are_not_applicable_under_ep_with_the_reason(fsdp_check):
    case = moe_case(2, 2)
    held = case_contracts(case)
    assert not held.comm and not held.memory and "expert parallelism's all-to-all dispatch" in held.why
    verdict = fsdp_check(case, calibrate=False)
    assert verdict.ok, verdict.summary()
    assert all(f.kind == "skipped" for f in verdict.findings if f.phase in ("comm", "memory"))


# ---- mutants -------------------------------------------------------------------------------------------
MUTANTS = [
    ("ep_tokens_combined_out_of_order", {"ep": 2}, {}, "logits"),
    ("ep_expert_grads_averaged_over_ep", {"ep": 2}, {}, "grads"),
    ("aux_loss_per_rank", {"ep": 1}, {"aux_loss": 0.5}, "grads"),
    ("router_bias_updated_on_rank0_only", {"ep": 2}, {"router_bias": 0.05}, "buffers"),
    ("capacity_drops_differ_on_rank1", {"ep": 2}, {"capacity_factor": 0.5}, "logits"),
    ("clip_norm_of_one_mesh", {"ep": 2, "clip_norm": 0.05}, {}, "grad_norm"),
]


@pytest.mark.parametrize(("mutant", "case", "model", "phase"), MUTANTS, ids=[m[0] for m in MUTANTS])
def test_each_expert_parallel_mutant_is_caught(fsdp_check, mutant, case, model, phase):
    engine = f"fsdp_verify.zoo.mutants:{mutant}"
    verdict = fsdp_check(
        moe_case(2, case["ep"], **model).with_(engine=engine, steps=2, clip_norm=case.get("clip_norm"))
    )
    assert not verdict.ok
    assert verdict.first_divergence.phase == phase, verdict.summary()


@pytest.mark.parametrize(("mutant", "case", "model", "phase"), MUTANTS[2:], ids=[m[0] for m in MUTANTS[2:]])
def test_a_routing_mutant_is_invisible_without_its_feature(fsdp_check, mutant, case, model, phase):
    """The mutants are mutations of what they name: with that feature off they train correctly."""
    verdict = fsdp_check(moe_case(2, case["ep"]).with_(engine=f"fsdp_verify.zoo.mutants:{mutant}"), calibrate=False)
    assert verdict.ok, verdict.summary()


# ---- opt-in, declared, applied ---------------------------------------------------------------------------
def test_a_plugin_that_declares_nothing_refuses_ep_naming_the_declaration(capsys):
    """In process (the CLI's exit code end to end: docs/expert-parallel.md's console block)."""
    args = ["check", "--engine", EVERYTHING, "--model", "mlp", "--experts", "4", "--top-k", "2", "--ep", "2"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "ep: expected 1" in err and "Capabilities(takes=('ep', ...))" in err and "Traceback" not in err, err


@settings(max_examples=150, database=None, deadline=None, suppress_health_check=list(HealthCheck))
@given(case=cases(engine=EVERYTHING, hsdp=True, model_kinds=("mlp",)))
def test_ep_is_never_drawn_for_an_engine_that_does_not_declare_it(case):
    assert case.ep == 1
    refuse_untakeable(case)


def test_fsdp2_is_drawn_ep_with_fsdp_and_hsdp_and_grouped_routing():
    # drawn where asked (`--ep 1 2 4`); pp pinned to 1: a pipeline takes the routed experts away
    strategy = cases(
        engine="fsdp2", world_sizes=(2, 4), hsdp=True, model_kinds=("mlp",), experts=4, ep=[1, 2, 4], pp=[1]
    )
    drawn = draw_cases(strategy, 80, 40)
    seen = Counter((c.ep, len(c.mesh)) for c in drawn if c.ep > 1)
    assert {(2, 1), (2, 2)} <= set(seen) and any(ep == 4 for ep, _ in seen), seen
    grouped = [c.model for c in drawn if c.model.top_k is not None]
    assert any(m.capacity_factor for m in grouped) and any(m.aux_loss for m in grouped)
    assert any(m.router_bias for m in grouped)
    for case in drawn:
        refuse_untakeable(case)


@pytest.mark.parametrize(
    ("engine", "evidence"),
    [
        ("drops_ep", "is not distributed over an 'ep' mesh dim"),
        ("drops_ep_divide_factor", "not by the data-parallel size 2"),
    ],
)
def test_a_declared_ep_the_engine_does_not_apply_is_named(fsdp_check, engine, evidence):
    verdict = fsdp_check(moe_case(2, 2).with_(engine=f"tests/engines/undelivered.py:{engine}"))
    first = verdict.first_divergence
    assert (first.step, first.phase, first.name) == (0, "build", "<ep>"), verdict.summary()
    assert "did not apply `ep`" in first.message and evidence in first.message, first.message


# ---- bad input -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("changes", "field", "words"),
    [
        ({"ep": 3}, "ep", "a divisor of the experts (4)"),
        ({"world_size": 2, "ep": 4}, "ep", "a divisor of the shard dimension 2"),
        ({"model": ModelSpec(kind="mlp", experts=4), "ep": 2}, "ep", "grouped routed experts"),
        ({"ep": 2, "wrap": ("layers.0", "")}, "wrap", "'moe.experts' as a unit of its own"),
        ({"ep": 2, "offload": True}, "offload", "not modelled"),
        ({"ep": 4, "precision": PrecisionSpec(param_dtype="fp16")}, "precision.reduce_dtype", "divides the experts"),
        (
            {"grad_reduction": "sum", "model": ModelSpec(kind="mlp", experts=4, top_k=1, aux_loss=0.1)},
            "model.aux_loss",
            "",
        ),
        ({"model": ModelSpec(kind="mlp", experts=4, top_k=5)}, "model.top_k", "in [1, experts=4]"),
        ({"model": ModelSpec(kind="mlp", experts=4, capacity_factor=1.0)}, "model.capacity_factor", "with top_k"),
    ],
)
def test_bad_expert_parallel_input_names_the_field(changes, field, words):
    base = {"model": ModelSpec(kind="mlp", experts=4, top_k=2), "world_size": 4, "data": DataSpec(batch_size=8)}
    with pytest.raises(CaseError) as e:
        Case(**{**base, **changes})
    assert e.value.field_path == field and words in str(e.value), str(e.value)


def test_loss_scaling_beside_an_aux_loss_is_refused():
    with pytest.raises(CaseError, match="model.aux_loss"):
        Case(
            model=ModelSpec(kind="mlp", experts=4, top_k=1, aux_loss=0.1),
            precision=PrecisionSpec(param_dtype="fp16"),
            loss_scaling=LossScaleSpec(),
        )


def test_grouped_experts_default_plan_gives_the_experts_a_unit_and_frozen_experts_stay_frozen():
    case = moe_case(2, 2, frozen=("moe.experts",))
    assert case.wrap_plan[0] == "moe.experts"
    model = build_model(case.model, 0)
    assert not model.moe.experts.weight.requires_grad


def test_a_crash_of_the_known_reduce_order_bug_says_so():
    """PyTorch's: with the gate and the first block frozen and one expert bias trainable, FSDP2
    orders its reduce-scatters by the routing (tests/upstream/test_fsdp2_unused_params_reduce_order.py);
    sweep seed 5011's crash, shrunk. `check` reports the rank crash and names the known bug; the
    draw makes the gate trainable instead."""
    from fsdp_verify.engines.routed_reduction import ORDER_REPRO, routing_decides_requires_grad
    from fsdp_verify.runner import check_case
    from fsdp_verify.sharded.pool import RankFailure
    from tests.conftest import regression

    case = regression("5db31dca07bb")
    assert routing_decides_requires_grad(case.model)
    with pytest.raises(RankFailure) as e:
        check_case(case)
    assert e.value.kind == "crash" and "collective mismatch" in str(e.value), str(e.value)
    assert "known PyTorch bug" in str(e.value) and ORDER_REPRO in str(e.value), str(e.value)
