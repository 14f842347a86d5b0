"""Issue 39: FSDP2 composed with tensor and sequence parallelism (docs/tensor-parallel.md).

The case's fields and flags, their validation, and the capability they need (a plug-in engine that
declares nothing is never drawn tensor parallelism, and asking for it is bad input naming the
field and the declaration)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fsdp_verify.case import Case, ModelSpec
from fsdp_verify.commands.case_flags import case_to_flags
from fsdp_verify.properties.strategies import PinError, cases
from fsdp_verify.validation import CaseError

PLAIN = "examples/engine/my_engine.py:shard"
TINY = ModelSpec(vocab_size=64, dim=16, n_heads=2, ffn_hidden=24, n_layers=1, seq_len=4)


def tp_case(**changes) -> Case:
    base = {"model": TINY, "world_size": 2, "tp": 2, "steps": 2, "data": Case().data}
    return Case(**{**base, **changes})


# ---- the case --------------------------------------------------------------------------------------
def test_the_world_counts_every_rank_and_the_mesh_is_the_data_parallel_part():
    case = tp_case(world_size=8, mesh_shape=(2, 2))
    assert (case.dp_size, case.mesh, case.device_mesh_shape, case.local_batch) == (4, (2, 2), (2, 2, 2), 2)
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
def test_a_plain_plugin_is_never_drawn_tensor_parallelism():
    with pytest.raises(PinError, match=r"tp: expected 1: engine .* does not declare `tp`"):
        cases(engine=PLAIN, tp=2)


def test_check_with_tp_on_a_plugin_that_declares_nothing_exits_2():
    run = subprocess.run(
        [sys.executable, "-m", "fsdp_verify", "check", "--engine", PLAIN, "--tp", "2", "--vocab-size", "64"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr
    assert "tp: expected 1" in run.stderr and "Capabilities(takes=('tp', ...))" in run.stderr
