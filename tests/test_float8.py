"""Float8 training (issue 51), the first dimension package (verify/dims/float8/): torchao's
conversion composed with FSDP2, bit-exact against the reference at world sizes 1-4 and HSDP, the
float8 all-gather on and off, fp32 and bf16 parameters; the contracts modelled (the float8
all-gather's bytes and its amax all-reduces); the knobs check and the mutants; opt-in for a
plug-in engine; the case, its flags and the draws."""

from __future__ import annotations

import json

import pytest
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from fsdp_verify.case import Case, ModelSpec
from fsdp_verify.case_specs import DataSpec
from fsdp_verify.commands.case_flags import case_to_flags
from fsdp_verify.dims.float8 import Float8Spec, builtin_linears, converts
from fsdp_verify.dims.registry import packages
from fsdp_verify.engines.capabilities import Capabilities
from fsdp_verify.engines.spec import ShardSpec
from fsdp_verify.properties.draw import draw_cases
from fsdp_verify.properties.pins import PinError
from fsdp_verify.properties.strategies import cases
from fsdp_verify.runner import refuse_untakeable
from fsdp_verify.validation import CaseError
from tests.conftest import require

require("torchao")

MLP16 = ModelSpec(kind="mlp", widths=(16, 32, 48, 16))
LM = ModelSpec(kind="transformer", dim=32, ffn_hidden=48, vocab_size=40, n_layers=2, seq_len=4)
MUTANTS = "fsdp_verify.dims.float8.mutants:"


def _case(world: int = 2, model: ModelSpec = MLP16, float8: Float8Spec | None = None, **changes) -> Case:
    changes.setdefault("steps", 2)
    batch = DataSpec(batch_size=changes.get("world_size", world) * changes.get("microbatches", 1) * 2)
    spec = float8 or Float8Spec("tensorwise")
    return Case(model=model, world_size=world, data=batch).with_(**{"dims.float8": spec, **changes})


def _inexact(verdict) -> list:
    return [(f.key, f.max_abs) for f in verdict.findings if f.phase != "param_sums" and f.max_abs not in (0, None)]


GATHER = Float8Spec("tensorwise", all_gather=True)
CORRECT = [
    (1, None, Float8Spec("tensorwise"), "fp32"),
    (2, None, GATHER, "bf16"),
    (2, None, Float8Spec("tensorwise", all_gather=True, precompute=True), "fp32"),
    (4, (2, 2), Float8Spec("tensorwise", all_gather=True, precompute=True), "bf16"),
    (4, None, Float8Spec("rowwise"), "bf16"),
    (3, None, Float8Spec("rowwise_with_gw_hp"), "fp32"),
]


@pytest.mark.parametrize(("world", "mesh", "float8", "dtype"), CORRECT)
def test_correct_float8_training_is_bit_exact_contracts_included(fsdp_check, world, mesh, float8, dtype):
    """Every record exact, the communication and memory contracts passing: the float8 all-gather
    gathers the converted weights as float8 (uint8 beside the biases) and casts each after an
    all-reduce of its amax (none once its scale is precomputed, after the first step)."""
    world_size = 4 if mesh else world
    case = _case(world_size, LM if dtype == "bf16" else MLP16, float8, mesh_shape=mesh, microbatches=2)
    if dtype == "bf16":
        case = case.with_(**{"precision.param_dtype": "bf16", "precision.reduce_dtype": "fp32"})
    verdict = fsdp_check(case, calibrate=False)
    assert verdict.ok, verdict.summary()
    assert not _inexact(verdict)
    phases = {f.phase for f in verdict.findings}
    assert {"comm", "memory", "build", "dims"} <= phases, phases
    (own,) = [f for f in verdict.findings if f.phase == "dims"]  # float8's own check (test_float8_rounding.py)
    assert own.ok and "within the rounding bound of its casts" in own.message


@pytest.mark.parametrize(("scope", "backend"), [("units", "aot_eager"), ("model", "eager")])
def test_compiled_float8_is_bit_exact_and_inductor_is_refused(fsdp_check, scope, backend):
    """Compiled beside float8, units or the whole model, the reference compiled alike: the same
    graphs, bit-exact. Inductor's fusions of the float8 casts are not modelled: refused, naming
    `compile_backend`."""
    case = _case(2, LM, GATHER, compile=scope, compile_backend=backend)
    case = case.with_(**{"precision.param_dtype": "bf16"})
    verdict = fsdp_check(case, calibrate=False)
    assert verdict.ok, verdict.summary()
    assert not _inexact(verdict)
    with pytest.raises(CaseError, match=r"^compile_backend: expected aot_eager or eager beside float8"):
        case.with_(compile_backend="inductor")


def test_the_compilers_fusion_bound_runs_beside_float8_tensors():
    """The compiler's check moves the eager reference by what a compiler may change
    (reference/fusion.py); a float8 tensor's ops are left to the plain ops they are made of (it
    raised on the first float8 matmul before: sweep 8201)."""
    from fsdp_verify.reference import train_reference

    case = _case(2, LM, GATHER, compile="units", compile_backend="aot_eager", steps=1)
    moved = train_reference(case, fusion=1)
    assert moved.meta["moved"] is not None and (1, "loss", "loss") in moved.records


@pytest.mark.parametrize(
    ("mutant", "float8", "phase"),
    [
        ("float8_amax_of_local_shard", GATHER, "logits"),
        ("float8_scales_never_recomputed", GATHER, "comm"),
        ("float8_gather_scale_cached", GATHER, "comm"),
        ("float8_grad_output_in_e4m3", Float8Spec("tensorwise"), "grads"),
    ],
)
def test_each_float8_mutant_is_caught_where_it_breaks(fsdp_check, mutant, float8, phase):
    """Each at the first record it changes: the local amax in the first forward's logits; the
    stale scales (precomputed once at setup, or the first gather's cached) in the first step's
    communication (a gather without its amax all-reduce, though the case precomputes none) and
    then in the second step's logits (the weights cast with the first step's scales); the e4m3
    output gradients in the first step's gradients, located to a converted layer."""
    caught = fsdp_check(_case(2, float8=float8, steps=2, engine=MUTANTS + mutant), calibrate=False)
    assert not caught.ok
    first = caught.first_divergence
    assert first.phase == phase, caught.summary()
    if phase == "comm":
        assert {(f.step, f.phase) for f in caught.findings if not f.ok} >= {(2, "logits")}
    if phase == "grads":
        assert first.name.startswith("layers."), first.name  # a converted layer's weight or bias


def _converts_nothing(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Declares float8 and never calls `spec.convert`."""
    kwargs = spec.fully_shard_kwargs(model, mesh)
    for fqn in spec.wrap:
        fully_shard(model.get_submodule(fqn), **kwargs)
    return model


_converts_nothing.capabilities = Capabilities(takes=("float8",))


def test_an_engine_that_declares_float8_and_does_not_convert_is_named(fsdp_check):
    verdict = fsdp_check(_case(2, engine="tests.test_float8:_converts_nothing"), calibrate=False)
    assert not verdict.ok
    assert verdict.first_divergence.phase == "build", verdict.summary()
    assert "not converted (convert_to_float8_training before fully_shard)" in verdict.summary()


def _plain(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    for fqn in spec.wrap:
        fully_shard(model.get_submodule(fqn), mesh=mesh, mp_policy=spec.mp_policy)
    return model


def test_float8_is_opt_in_for_a_plug_in_engine():
    """A plain fully_shard plug-in that declares nothing is never drawn float8, and a case asking
    for it is refused, naming the field and how to declare it."""
    with pytest.raises(CaseError, match=r"^dims\.float8: expected .*does not declare `float8`"):
        refuse_untakeable(_case(2, engine="tests.test_float8:_plain"))
    with pytest.raises(PinError, match=r"^dims\.float8\.recipe: expected .*does not declare `float8`"):
        cases(engine="tests.test_float8:_plain", **{"dims.float8.recipe": "tensorwise"})
    drawn = draw_cases(cases(engine="tests.test_float8:_plain", world_sizes=(2,)), 40, 3)
    assert all(c.dims.float8 == Float8Spec() for c in drawn)
    fsdp2 = draw_cases(cases(world_sizes=(2, 4), hsdp=True), 80, 3)
    assert any(c.dims.float8.recipe for c in fsdp2)


def test_the_case_json_flags_and_hash():
    """Off, a case keeps the JSON and the hash it had before the package; on, its spec is one
    object under `dims`, and its flags rebuild it."""
    assert "dims" not in Case().to_dict() and Case().hash == "fd77d80f9b93"
    case = _case(2, float8=Float8Spec("tensorwise", all_gather=True, precompute=True, skip=("layers.2",)))
    assert json.loads(case.to_json())["dims"] == {
        "float8": {"recipe": "tensorwise", "all_gather": True, "precompute": True, "skip": ["layers.2"]}
    }
    assert Case.from_json(case.to_json()) == case
    flags = case_to_flags(case)
    assert flags[flags.index("--float8") + 1] == "tensorwise" and "--float8-all-gather" in flags
    assert "--float8-skip" in flags


@pytest.mark.parametrize(
    ("changes", "field", "says"),
    [
        ({"dims.float8": Float8Spec("rowwise", all_gather=True)}, "dims.float8.all_gather", "tensorwise scaling only"),
        ({"dims.float8": Float8Spec("tensorwise", precompute=True)}, "dims.float8.precompute", "all_gather true"),
        ({"dims.float8": Float8Spec("e5m2")}, "dims.float8.recipe", "one of"),
        ({"dims.float8": GATHER, "reshard_after_forward": 2, "world_size": 4}, "reshard_after_forward", "NotImpl"),
        ({"dims.float8": GATHER, "world_size": 3, "data.batch_size": 6}, "dims.float8.all_gather", "ao#3982"),
        ({"model": ModelSpec(kind="mlp", widths=(8, 12, 4))}, "dims.float8", "none would be converted"),
        ({"tp": 2, "world_size": 4, "model": LM, "data.batch_size": 4}, "tp", "float8 training is not modelled"),
    ],
)
def test_bad_float8_cases_name_the_field(changes, field, says):
    with pytest.raises(CaseError) as e:
        _case(2, **changes)
    assert e.value.field_path == field and says in str(e.value), str(e.value)


def test_the_draw_keeps_float8_beside_what_the_table_allows():
    """Drawn on, never beside a row of the table (compile only without Inductor); widths made multiples of 16;
    the float8 all-gather only where every converted weight's rows divide over the shard group."""
    drawn = draw_cases(cases(world_sizes=(1, 2, 3, 4), hsdp=True, **{"dims.float8.recipe": "tensorwise"}), 60, 11)
    on = [c for c in drawn if c.dims.float8.recipe]
    assert len(on) > len(drawn) // 3
    for c in on:
        assert (c.tp, c.ep, c.pp, c.offload, c.zoom) == (1, 1, 1, False, None)
        assert c.compile is None or c.compile_backend != "inductor"
        rows = [o for n, i, o, t in builtin_linears(c.model) if converts(n, i, o, t, c.dims.float8)]
        assert rows and (not c.dims.float8.all_gather or all(o % c.mesh[-1] == 0 for o in rows))
    assert any(c.dims.float8.all_gather for c in on)


def test_float8_is_one_package_and_one_registration_line():
    """What adding a dimension takes: its package and its line in verify/dims/registered.py."""
    from fsdp_verify.dims import registered

    assert "fsdp_verify.dims.float8" in registered.PACKAGES
    assert [p.name for p in packages()] == ["float8"]


@pytest.mark.parametrize("case_hash", ["c383cd01906a", "30f308dbc7bb"])
def test_a_frozen_unit_gathered_by_a_prefetch_alone_casts_nothing_alone_and_keeps_its_scale(fsdp_check, case_hash):
    """CI's fresh-seed false alarms on correct FSDP2 (world sizes 1 and 2), the first layer frozen
    and float8 all-gathered: the next unit's backward prefetches the frozen one and nothing waits
    on that gather. At one rank the wait makes the copy, so its amax all-reduce is never issued
    (the communication contract expected it); over two the gather runs and leaves the weight's
    scale (4 B) on it until the next forward copies it out (the memory contract allowed none).
    Two steps: the second forward consumes what the first backward left."""
    from tests.conftest import regression

    case = regression(case_hash).with_(steps=2)
    verdict = fsdp_check(case, calibrate=False)
    assert verdict.ok, verdict.summary()
    judged = {(f.comparator, f.kind) for f in verdict.findings}
    assert {("CommContract", "check"), ("MemoryContract", "check")} <= judged, judged


def test_a_unit_whose_other_parameters_are_ignored_gathers_float8_alone_and_is_not_drawn_so():
    """Sweep 9502 drew the float8 all-gather for a root unit whose bias is an ignored parameter:
    FSDP2 gathers the weight alone, in float8, which gloo cannot ("Invalid scalar type"). The rule
    counts only what FSDP2 gathers; the draw keeps the all-gather off there, and a case asking for
    it is named by the engine step (on the ranks, over gloo)."""
    from fsdp_verify.dims.float8 import float8_only_units
    from tests.conftest import regression

    case = regression("8cfa1297599b")
    assert float8_only_units(case, case.dims.float8) == [""]
    assert float8_only_units(case.with_(ignored=()), case.dims.float8) == []


def test_a_transformers_model_in_float8_has_its_amax_all_reduces_recorded(fsdp_check):
    """transformers imports torchao, and a rank's zygote imports both before any probe wraps funcol
    (verify/sharded/zygote.py): torchao's amax all-reduce, bound by name at its import, is pointed
    at the probe's wrapper (verify/probes/comm.py `_rebind_copies`). Without that the communication
    contract finds every amax all-reduce missing ("expected all_reduce fp32 of 4 B ... none issued",
    measured on this case)."""
    llama = ModelSpec(kind="custom", factory="fsdp_verify.models.hf:tiny_llama", seq_len=4)
    case = _case(2, llama, GATHER, steps=1, wrap=("model.layers.0", "model.layers.1", ""))
    case = case.with_(**{"precision.param_dtype": "bf16", "precision.reduce_dtype": "fp32"})
    verdict = fsdp_check(case, calibrate=False)
    assert verdict.ok, verdict.summary()
    assert ("CommContract", "check") in {(f.comparator, f.kind) for f in verdict.findings}
