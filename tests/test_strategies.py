"""The case strategies: every draw is a valid, tiny Case; pins fix or draw fields; the pieces compose.
(Generation only: no rank runs here.)"""

import pytest
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st

from fsdp_verify.case import Case, ModelSpec
from fsdp_verify.case_specs import PrecisionSpec
from fsdp_verify.properties.fsdp1 import fsdp1_modelled
from fsdp_verify.properties.model_draws import models, wrap_plans
from fsdp_verify.properties.pins import PinError
from fsdp_verify.properties.strategies import cases, data_specs, optim_specs, precision_specs, reshard_values
from fsdp_verify.units import owner_of_module as _owner
from tests.conftest import regression

FAST = settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(cases())
def test_every_case_is_valid_and_tiny(case):
    assert Case.from_json(case.to_json()) == case  # valid (validation runs on construction) and round-trips
    m = case.model
    if m.kind == "mlp":
        assert 2 <= len(m.widths) <= 4 and max(m.widths) <= 40
    else:
        assert m.n_layers <= 3 and m.dim <= 32 and m.vocab_size <= 40 and m.ffn_hidden <= 40 and m.seq_len <= 8
        assert m.dim % m.n_heads == 0 and (m.dim // m.n_heads) % 2 == 0
    assert case.steps <= 3 and 1 <= case.microbatches <= 4 and case.world_size in (1, 2, 3, 4)
    assert case.data.batch_size <= 2 * case.world_size * case.microbatches
    assert case.data.batch_size % (case.world_size * case.microbatches) == 0
    assert case.engine == "fsdp2" and case.mesh_shape is None
    if case.data.kind == "cancellation":
        assert m.kind == "mlp"
    if m.kind == "transformer" and m.tie_embeddings:
        assert _owner(case.wrap_plan, "tok_embeddings") == _owner(case.wrap_plan, "output")
    rsf = case.reshard_after_forward
    if not isinstance(rsf, bool):  # FSDP2: an int must be a non-trivial divisor of the shard size
        assert 1 < rsf < case.world_size and case.world_size % rsf == 0
    p = case.precision
    assert p == PrecisionSpec() or (p.param_dtype == "bf16" and p.reduce_dtype in ("fp32", "bf16"))
    if case.clip_norm is not None:
        assert case.clip_norm <= 1e-2  # small enough to clip a tiny model's gradients
    trainable = [n for n in _names(m) if not any(n == f or n.startswith(f + ".") for f in m.frozen)]
    assert trainable


def _names(spec):
    from fsdp_verify.properties.model_draws import param_names

    return param_names(spec)


@FAST
@given(cases(world_sizes=(3,), precisions=("bf16",), model_kinds=("transformer",)))
def test_world_sizes_precisions_and_model_kinds_restrict_the_draw(case):
    assert case.world_size == 3 and case.precision.param_dtype == "bf16" and case.model.kind == "transformer"


@FAST
@given(cases(engine="fsdp1", precisions=("bf16",)))
def test_fsdp1_cases_are_only_what_fsdp1_expresses_and_the_reference_models(case):
    assert case.engine == "fsdp1" and case.precision.output_dtype is None and fsdp1_modelled(case)


def test_fsdp1_modelled_names_the_known_gaps():
    bf16 = PrecisionSpec(param_dtype="bf16", reduce_dtype="fp32")
    base = Case(model=ModelSpec(kind="mlp"), world_size=2, engine="fsdp1", precision=bf16)
    assert fsdp1_modelled(base) and fsdp1_modelled(base.with_(microbatches=2))
    assert not fsdp1_modelled(base.with_(microbatches=2, sync_every_microbatch=False))  # no-sync in bf16
    # NO_SHARD reducing its running sum through a bf16 reduce_dtype is modelled (`FlatLayout.carry`, reference/reduction.py)
    no_shard = base.with_(world_size=1, microbatches=2, **{"precision.reduce_dtype": "bf16"})
    assert fsdp1_modelled(no_shard)
    tied = Case(
        model=ModelSpec(kind="transformer", tie_embeddings=True, frozen=("tok_embeddings",)),
        world_size=2,
        engine="fsdp1",
        wrap=("layers.0", ""),
    )
    assert fsdp1_modelled(tied)  # sharded: FSDP1 runs it
    for no_shard_mesh in ({"world_size": 1}, {"mesh_shape": (2, 1)}):  # FSDP1's own assertion
        assert not fsdp1_modelled(tied.with_(**no_shard_mesh))
    # NO_SHARD saving a root whose own parameters are all frozen: FSDP1's state_dict() asserts
    frozen_root = regression("6623a1f52a02")
    assert not fsdp1_modelled(frozen_root) and fsdp1_modelled(
        frozen_root.with_(resume_after=None, resume_world_size=None)
    )
    assert fsdp1_modelled(frozen_root.with_(world_size=2, **{"data.batch_size": 2}))  # sharded: it saves
    assert fsdp1_modelled(frozen_root.with_(**{"model.frozen": ("moe.gate.weight",)}))  # partly frozen
    assert not fsdp1_modelled(regression("27731e33e8e1"))  # a unit other than the root frozen whole


def test_fsdp1_no_shard_unfreezes_are_drawn_except_where_fsdp1_loses_the_gradient():
    """Two PyTorch bugs under NO_SHARD (tests/upstream/): no-sync micro-batches drop an unfrozen
    parameter's accumulated gradient; a root unit frozen whole through a forward never trains."""
    mlp = ModelSpec(kind="mlp", widths=(2, 2, 2), frozen=("layers.1.linear.weight",))
    base = Case(model=mlp, world_size=1, engine="fsdp1", wrap=("layers.0", ""), steps=2, unfreeze_step=2)
    assert fsdp1_modelled(base)  # the root keeps a trainable parameter (its bias)
    assert fsdp1_modelled(base.with_(**{"model.frozen": ("layers.0",)}))  # a whole unit, not the root
    assert not fsdp1_modelled(base.with_(microbatches=2, sync_every_microbatch=False))
    whole_root = base.with_(**{"model.frozen": ("layers.1",)})
    for no_shard_mesh in ({}, {"world_size": 2, "mesh_shape": (2, 1)}):
        assert not fsdp1_modelled(whole_root.with_(**no_shard_mesh))
    assert fsdp1_modelled(whole_root.with_(world_size=2))  # FULL_SHARD unfreezes it
    assert fsdp1_modelled(whole_root.with_(unfreeze_step=None))  # frozen throughout


@settings(max_examples=60, deadline=None, database=None)
@given(
    cases(
        engine="fsdp_verify.zoo.mutants:grads_divided_twice",
        steps=1,
        clip_norm=st.sampled_from((0.5, 0.25)),
        **{"optim.name": "sgd", "optim.lr": 0.5, "model.dropout": 0.0, "data.kind": "cancellation"},
    )
)
def test_pins_fix_values_or_draw_from_a_strategy_including_dotted_names(case):
    assert case.engine == "fsdp_verify.zoo.mutants:grads_divided_twice" and case.steps == 1
    assert case.clip_norm in (0.5, 0.25)
    assert case.optim.name == "sgd" and case.optim.lr == 0.5
    assert case.model.dropout == 0.0 and case.model.kind == "mlp"  # cancellation data: MLPs only
    assert case.data.kind == "cancellation"


@settings(max_examples=30, deadline=None, database=None)
@given(cases(world_sizes=(2, 3), **{"data.batch_size": 12}))
def test_a_pinned_batch_size_only_meets_world_sizes_and_microbatches_that_divide_it(case):
    assert case.data.batch_size == 12 and 12 % (case.world_size * case.microbatches) == 0


def test_unknown_pins_and_options_are_named():
    with pytest.raises(PinError, match="'optim.nmae'"):
        cases(**{"optim.nmae": "sgd"})
    with pytest.raises(PinError, match="precisions"):
        cases(precisions=("fp8",))
    with pytest.raises(PinError, match="world_sizes"):
        cases(world_sizes=(0,))
    with pytest.raises(PinError, match="model_kinds"):
        cases(model_kinds=("cnn",))


@settings(max_examples=60, deadline=None, database=None)
@given(st.data())
def test_the_pieces_compose_into_a_case(data):
    model = data.draw(models(("mlp", "transformer")))
    precision = data.draw(precision_specs(("bf16",), reduce_dtype="bf16"))
    plan = data.draw(wrap_plans(model, precision=precision))
    optim = data.draw(optim_specs(name="adamw"))
    spec = data.draw(data_specs(2, model.kind))
    case = Case(model=model, wrap=plan, world_size=2, precision=precision, optim=optim, data=spec)  # valid
    assert case.wrap_plan[-1] == "" and precision.reduce_dtype == "bf16"
    assert optim.name == "adamw" and optim.weight_decay > 0


@settings(max_examples=60, deadline=None, database=None)
@given(st.data())
def test_without_input_casting_no_mlp_linear_is_its_own_unit(data):
    """MLPBlock casts its input to its Linear's weight dtype, which a separately wrapped Linear
    only has after its own pre-forward: such plans cannot run without cast_forward_inputs."""
    model = data.draw(models(("mlp",)))
    plan = data.draw(wrap_plans(model, precision=PrecisionSpec("bf16", cast_forward_inputs=False)))
    assert not any(unit.endswith(".linear") for unit in plan)


def test_reshard_after_forward_ints_are_non_trivial_divisors():
    assert find(reshard_values(4), lambda v: not isinstance(v, bool)) == 2
    with pytest.raises(Exception, match="No examples found"):
        find(
            reshard_values(2),
            lambda v: not isinstance(v, bool),
            settings=settings(database=None, max_examples=50, derandomize=True),
        )


@settings(max_examples=60, deadline=None, database=None)
@given(cases(hsdp=True, reshard_after_forward=2))
def test_a_pinned_int_reshard_after_forward_draws_only_meshes_whose_shard_dimension_it_divides(case):
    """FSDP2 refuses an int that does not divide the shard group (capabilities.py): the draw
    draws around the pin, so no drawn case is refused before it runs."""
    from fsdp_verify.engines import refuse_untakeable

    assert case.reshard_after_forward == 2 and case.mesh[-1] % 2 == 0 and case.world_size in (2, 4)
    refuse_untakeable(case)


def test_a_pinned_int_reshard_after_forward_no_world_size_takes_is_refused_up_front(tmp_path):
    with pytest.raises(PinError, match=r"reshard_after_forward: 2 divides the shard group of no world size"):
        cases(hsdp=True, reshard_after_forward=2, world_sizes=(1, 3))
    with pytest.raises(PinError, match=r"reshard_after_forward: .*mesh_shape \(2, 1\)"):
        cases(hsdp=True, reshard_after_forward=2, mesh_shape=(2, 1))
    cases(engine="fsdp1", reshard_after_forward=2, world_sizes=(3,))  # FSDP1 takes any int as True
    from fsdp_verify.commands.cli import main

    argv = ["sweep", "--hsdp", "--reshard-after-forward", "2", "--world-sizes", "1", "3", "--cases", "2"]
    assert main([*argv, "--out", str(tmp_path)]) == 2  # bad input, before any rank starts


def test_tied_embeddings_keep_embedding_and_output_with_the_root():
    spec = ModelSpec(kind="transformer", dim=8, n_heads=2, n_layers=1, ffn_hidden=5, seq_len=4, tie_embeddings=True)
    plan = find(wrap_plans(spec), lambda p: len(p) >= 6, settings=settings(database=None, derandomize=True))
    assert "tok_embeddings" not in plan and "output" not in plan


def test_the_simplest_case_is_small():
    """What shrinking aims at: one rank... or the fewest the predicate needs, one step, root only."""
    case = find(
        cases(world_sizes=(1, 2, 3, 4)),
        lambda c: c.world_size >= 2 and c.model.kind == "mlp",
        settings=settings(
            database=None, max_examples=50, suppress_health_check=[HealthCheck.too_slow], derandomize=True
        ),
    )
    assert case.world_size == 2 and case.steps == 1 and case.model.n_blocks <= 2 and case.microbatches == 1


def test_routing_never_decides_what_requires_grad_in_a_drawn_case():
    """torch 2.13's FSDP2 orders its reduce-scatters by the routing where it decides whether the
    layer after routed experts gets an input that requires grad
    (tests/upstream/test_fsdp2_unused_params_reduce_order.py): sweep seed 5011's crash, shrunk.
    The draw makes the gate trainable there; a case that does not meet it is left alone."""
    from fsdp_verify.properties.expert_parallel import routing_never_decides_what_requires_grad as drawn

    frozen = ("layers.0", "moe.gate", "moe.experts.0", "moe.experts.1.weight")  # experts.1.bias trains
    case = Case(model=ModelSpec(kind="mlp", widths=(1, 4, 1), experts=2, frozen=frozen), world_size=2)
    mapped = drawn(case).model.frozen
    assert not any(n.startswith("moe.gate") for n in mapped) and "moe.experts.1.weight" in mapped, mapped
    assert "layers.0.linear.weight" in mapped and "moe.experts.0.bias" in mapped, mapped
    for kept in (
        case.with_(model=ModelSpec(kind="mlp", widths=(1, 4, 1), experts=2, frozen=frozen[1:])),  # layers.0 trains
        case.with_(model=ModelSpec(kind="mlp", widths=(1, 4, 1), experts=2, frozen=(*frozen, "moe.experts.1"))),
        case.with_(model=ModelSpec(kind="mlp", widths=(1, 4, 1), experts=2, frozen=frozen[:1] + frozen[2:])),
    ):
        assert drawn(kept) == kept
