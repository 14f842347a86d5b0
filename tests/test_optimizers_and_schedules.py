"""Optimizers whose state is not Adam's, learning-rate schedules and parameters unfrozen mid-run
(docs/optimizers-and-schedules.md): the Case refuses what cannot run, the strategies draw each
knob, the reference emulates it, FSDP2, FSDP1 and the flat engine match it at world sizes 1 to 4,
and each knob's mutant is caught with the knob on and passes with it off."""

from __future__ import annotations

import pytest
import torch

from fsdp_verify.case import Case, CaseError, ModelSpec
from fsdp_verify.case_specs import DataSpec, OptimSpec, PrecisionSpec
from fsdp_verify.engines import refuse_untakeable
from fsdp_verify.engines.capabilities import Capabilities
from fsdp_verify.properties.pins import PinError
from fsdp_verify.properties.strategies import cases
from fsdp_verify.reference import train_reference
from fsdp_verify.training.optim import make_optimizer, make_scheduler, step_scheduler
from tests.conftest import MLP
from tests.found import find

BF16 = PrecisionSpec(param_dtype="bf16", reduce_dtype="fp32")
MUTANT = "fsdp_verify.zoo.mutants:"
FROZEN_LAYER = ModelSpec(kind="mlp", widths=(16, 33, 17, 8), frozen=("layers.0",))


def _case(world_size: int, model: ModelSpec = MLP, **changes) -> Case:
    """The tests' MLP case (tests/conftest.py's `mlp_case`), with a model of its own if given."""
    changes.setdefault("data", DataSpec(batch_size=world_size * changes.get("microbatches", 1) * 2))
    changes.setdefault("steps", 2)
    return Case(model=model, world_size=world_size, **changes)


# ---- the Case ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"optim": OptimSpec(name="sgd", amsgrad=True)}, "optim.amsgrad"),
        ({"optim": OptimSpec(schedule="cosine")}, "optim.schedule"),
        ({"optim": OptimSpec(schedule="exponential", schedule_factor=0.0)}, "optim.schedule_factor"),
        ({"optim": OptimSpec(name="lamb")}, "optim.name"),
        ({"unfreeze_step": 2}, "model.frozen"),  # nothing frozen
        ({"model": FROZEN_LAYER, "unfreeze_step": 1}, "unfreeze_step"),
    ],
)
def test_a_case_that_cannot_run_names_the_field(changes, field):
    with pytest.raises(CaseError) as e:
        Case(**{"model": ModelSpec(kind="mlp"), **changes})
    assert e.value.field_path == field


def test_the_new_fields_at_their_defaults_keep_a_cases_json_and_hash():
    data = Case().to_dict()
    assert "unfreeze_step" not in data and not {"amsgrad", "schedule", "schedule_factor"} & set(data["optim"])
    assert Case().hash == "fd77d80f9b93"  # as before the fields existed
    case = Case(optim=OptimSpec(name="adam", amsgrad=True, schedule="exponential"))
    assert Case.from_json(case.to_json()) == case and case.hash != Case().hash


def test_the_flat_engine_refuses_an_unfreeze_step_as_bad_input():
    case = _case(2, model=FROZEN_LAYER, unfreeze_step=2, engine="flat")
    with pytest.raises(CaseError) as e:
        refuse_untakeable(case)
    assert e.value.field_path == "unfreeze_step"
    refuse_untakeable(_case(2, model=FROZEN_LAYER, unfreeze_step=2, engine="fsdp1"))
    with pytest.raises(PinError, match="unfreeze_step"):
        cases(engine="flat", unfreeze_step=2)
    routed = _case(2, model=ModelSpec(kind="mlp", experts=2), engine="flat")
    refuse_untakeable(routed)  # modelled now (`Arithmetic.computes_on_flat_views`)
    with pytest.raises(CaseError) as e:  # an engine that does not declare it takes experts
        Capabilities().refuse(routed, "plugin")
    assert e.value.field_path == "model.experts"


# ---- the pieces -----------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["exponential", "linear_warmup"])
def test_the_rate_changes_every_step(schedule):
    optimizer = make_optimizer(OptimSpec(name="sgd", lr=0.1), [torch.nn.Parameter(torch.zeros(2))])
    scheduler = make_scheduler(OptimSpec(schedule=schedule), optimizer, steps=3)
    rates = []
    for _ in range(3):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        step_scheduler(scheduler)
    assert len(set(rates)) == 3, rates
    assert make_scheduler(OptimSpec(), optimizer, steps=3) is None


def test_the_reference_trains_the_frozen_parameters_from_the_unfreeze_step_on():
    case = _case(1, model=FROZEN_LAYER, steps=3, unfreeze_step=2)
    trace = train_reference(case)
    name = "layers.0.linear.weight"
    assert (1, "grads", name) not in trace.records and (2, "grads", name) in trace.records
    initial = trace.records[(0, "init", name)]
    assert torch.equal(trace.records[(1, "params", name)], initial)
    assert not torch.equal(trace.records[(2, "params", name)], initial)


def test_the_reference_with_a_schedule_moves_otherwise_from_step_two():
    constant, scheduled = (
        train_reference(_case(1, steps=2, optim=OptimSpec(schedule=s))) for s in (None, "exponential")
    )
    name = "layers.0.linear.weight"
    assert torch.equal(constant.records[(1, "params", name)], scheduled.records[(1, "params", name)])
    assert not torch.equal(constant.records[(2, "params", name)], scheduled.records[(2, "params", name)])


KNOBS = {
    "adagrad": lambda c: c.optim.name == "adagrad",
    "rmsprop": lambda c: c.optim.name == "rmsprop",
    "amsgrad": lambda c: c.optim.amsgrad,
    "exponential": lambda c: c.optim.schedule == "exponential",
    "linear_warmup": lambda c: c.optim.schedule == "linear_warmup",
    "unfreeze": lambda c: c.unfreeze_step is not None and c.unfreeze_step <= c.steps,
}


@pytest.mark.parametrize("knob", list(KNOBS))
def test_the_strategies_draw_each_knob(knob):
    find(cases(), KNOBS[knob], max_examples=500)


# ---- correct engines at world sizes 1 to 4 --------------------------------------------------------
OPTIMIZER_CASES = [
    (1, "fsdp2", OptimSpec(name="adagrad", schedule="exponential"), None),
    (2, "fsdp2", OptimSpec(name="rmsprop", momentum=0.9, schedule="linear_warmup"), BF16),
    (3, "fsdp1", OptimSpec(name="adagrad", weight_decay=0.01), None),
    (4, "flat", OptimSpec(name="adamw", amsgrad=True, betas=(0.9, 0.5), schedule="exponential"), None),
    (3, "fsdp2", OptimSpec(name="adam", amsgrad=True, betas=(0.9, 0.5), schedule="linear_warmup"), BF16),
]


@pytest.mark.parametrize(("world", "engine", "optim", "precision"), OPTIMIZER_CASES)
def test_optimizers_and_schedules_match_the_reference(fsdp_check, world, engine, optim, precision):
    case = _case(world, engine=engine, optim=optim, steps=3, microbatches=2, precision=precision or PrecisionSpec())
    verdict = fsdp_check(case)
    assert verdict.ok, verdict.summary()
    states = {f.name.rsplit(".", 1)[1] for f in verdict.findings if f.phase == "optim_state"}
    assert states & {"sum", "square_avg", "max_exp_avg_sq"}, states  # the state beyond Adam's is compared


UNFREEZE_CASES = [
    (1, "fsdp2", PrecisionSpec(), False),
    # The unit layers.0 runs its first forward frozen. Reducing every micro-batch, it hits the PyTorch
    # bug the FSDP2 view works around (without it: a grad_dtype error on every rank); accumulating
    # without sync, the accumulated gradient is upcast to reduce_dtype first and the bug cannot show.
    (2, "fsdp2", BF16, False),
    (3, "fsdp1", BF16, False),
    (4, "fsdp2", BF16, True),
]


@pytest.mark.parametrize(("world", "engine", "precision", "sync_last"), UNFREEZE_CASES)
def test_parameters_unfrozen_mid_run_match_the_reference(fsdp_check, world, engine, precision, sync_last):
    case = _case(
        world,
        engine=engine,
        model=FROZEN_LAYER,
        wrap=("layers.0", "layers.1", ""),
        precision=precision,
        steps=3,
        microbatches=2,
        sync_every_microbatch=not sync_last,
        unfreeze_step=2,
        data=DataSpec(batch_size=world * 4),
    )
    verdict = fsdp_check(case)
    assert verdict.ok, verdict.summary()
    grads = {(f.step, f.name) for f in verdict.findings if f.phase == "grads"}  # compared on both sides
    assert (1, "layers.0.linear.weight") not in grads and (2, "layers.0.linear.weight") in grads


ROUTED = ModelSpec(kind="mlp", widths=(16, 33, 17, 8), experts=3)
EXPERT_CASES = [
    (1, "fsdp2", PrecisionSpec(), False),
    (2, "fsdp2", BF16, False),
    (3, "fsdp1", PrecisionSpec(), False),
    (4, "fsdp2", PrecisionSpec(param_dtype="bf16", reduce_dtype="bf16"), True),
    (2, "fsdp1", PrecisionSpec(), True),
    # The flat engine: 1.6x the tolerance on `moe.gate.bias` until the reference computed with
    # views laid out as its buffers (`Arithmetic.computes_on_flat_views`); bit-exact since.
    (2, "flat", PrecisionSpec(), False),
    (3, "flat", BF16, True),
]


@pytest.mark.parametrize(("world", "engine", "precision", "sync_last"), EXPERT_CASES)
def test_routed_experts_some_micro_batches_skip_match_the_reference(fsdp_check, world, engine, precision, sync_last):
    case = _case(
        world,
        engine=engine,
        model=ROUTED,
        precision=precision,
        microbatches=2,
        sync_every_microbatch=not sync_last,
        optim=OptimSpec(name="adam"),
        data=DataSpec(batch_size=world * 2),  # one sample a rank and micro-batch: most experts idle
    )
    verdict = fsdp_check(case)
    assert verdict.ok, verdict.summary()
    expert_grads = {f.name for f in verdict.findings if f.phase == "grads" and f.name.startswith("moe.experts")}
    assert len(expert_grads) == 6, expert_grads  # every expert compared (zeros where none was reached)
    if engine == "flat":  # its arithmetic is emulated to the bit, the gate's near-cancelling sums too
        assert max(f.ratio for f in verdict.findings if f.ratio is not None) == 0.0, verdict.summary()


def test_an_idle_expert_dropping_its_accumulated_gradient_is_caught_only_under_accumulation(fsdp_check):
    mutant = MUTANT + "idle_expert_grads_dropped"
    caught = fsdp_check(_case(2, engine=mutant, model=ROUTED, microbatches=2, data=DataSpec(batch_size=4)))
    first = caught.first_divergence
    assert first is not None and (first.step, first.phase) == (1, "grads"), caught.summary()
    assert first.name.startswith("moe.experts"), caught.summary()
    # One micro-batch: nothing accumulated to drop, the mutant trains as FSDP2 does.
    once = fsdp_check(_case(2, engine=mutant, model=ROUTED, microbatches=1, data=DataSpec(batch_size=2)))
    assert once.ok, once.summary()


# ---- each knob's mutant: caught with it, not without it -------------------------------------------
MUTANTS = [
    ("lr_scheduler_stepped_twice", {"optim": OptimSpec(schedule="linear_warmup")}, (2, "params")),
    (
        "optimizer_state_known_keys_only",
        {"optim": OptimSpec(name="adam", amsgrad=True, betas=(0.9, 0.5))},
        (1, "optim_state"),
    ),
    (
        "unfreeze_misses_sharded_params",
        {"model": ModelSpec(kind="mlp", frozen=("layers.0.linear.weight",)), "unfreeze_step": 2},
        (2, "grads"),
    ),
]


@pytest.mark.parametrize(("name", "knob", "where"), MUTANTS, ids=[m[0] for m in MUTANTS])
def test_the_knobs_mutant_is_caught_where_it_first_shows(fsdp_check, name, knob, where):
    verdict = fsdp_check(_case(2, engine=MUTANT + name, steps=2, **knob))
    first = verdict.first_divergence
    assert first is not None and (first.step, first.phase) == where, verdict.summary()


def _without(knob: dict) -> dict:
    """The knob off: the same case a correct engine and the mutant run alike."""
    if "unfreeze_step" in knob:
        return {"model": knob["model"]}
    return {"optim": OptimSpec(name="adam")}


@pytest.mark.parametrize(("name", "knob", "where"), MUTANTS, ids=[m[0] for m in MUTANTS])
def test_without_the_knob_the_mutant_trains_as_fsdp2(fsdp_check, name, knob, where):
    verdict = fsdp_check(_case(3, engine=MUTANT + name, steps=2, **_without(knob)))
    assert verdict.ok, verdict.summary()
