"""Pipeline parallelism's draw step: the stages, the schedule and its micro-batches (beside
reference/pipeline_parallel.py, its emulation)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from hypothesis import assume
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from fsdp_verify.case import Case, CaseError
from fsdp_verify.dims.together import beside_another, drawn_off, pinned_beside
from fsdp_verify.engines.expert_parallel import experts_of
from fsdp_verify.properties.meshes import hsdp_meshes
from fsdp_verify.properties.model_draws import experts_cannot_accumulate
from fsdp_verify.properties.pins import asked, pinned

ASKS_PIPELINE = {"pp": 1, "pp_schedule": None, "pp_split": None, "pp_scale_grads": True}


@st.composite
def pipelines(draw: Callable, case: Case, pins: dict[str, Any]) -> Case:
    """`case` cut into pipeline stages (docs/pipeline-parallel.md), drawn after everything else
    and only where asked (`ASKS_PIPELINE`: `--pp`, ...), so that a seed's draws stay what they
    were: a third of the draws where a degree
    divides the world size and the model has a block a stage, for an engine that takes `pp`
    (`_knob_pins` pins it to 1 otherwise). The data-parallel mesh is drawn again for the ranks a
    stage has; what the reference does not model beside a pipeline is drawn off (Case refuses
    it: verify/engines/pipeline_parallel.py), unless a pin asked for it, and the stages reduce
    once a step (sync on the last micro-batch only)."""
    from fsdp_verify.engines.pipeline_parallel import SCHEDULES

    if not asked(pins, ASKS_PIPELINE):
        return case
    blocks = case.model.n_blocks if not case.model.is_custom or "pp_split" in pins else 0
    ranks = case.world_size // case.tp  # beside tp (drawn before), the stages divide a tp rank's ranks
    degrees = [d for d in range(2, ranks + 1) if ranks % d == 0 and blocks >= d]
    pinned_on = pinned_beside("pp", case, pins)
    # A pinned mesh pins the world size to its product (`cases`): no room for stages beside it.
    # A case drawn expert-parallel stays so (verify/dims/together.py).
    if pinned_on or "mesh_shape" in pins or beside_another("pp", case):
        degrees = []
    if experts_cannot_accumulate(case.model, case.precision):  # a PyTorch bug, left out of the draws
        degrees = []
    if case.model.is_custom and experts_of(case.model):  # refused (verify/engines/expert_parallel.py)
        degrees = []
    pp = draw(
        pinned(pins, "pp", st.one_of(st.just(1), st.just(1), st.sampled_from(degrees)) if degrees else st.just(1))
    )
    if pp == 1:
        # A pipeline's own pins ask for one, unless the degrees asked for include 1 (`--pp 1 2`
        # beside a framework's pipeline fields): then a draw of 1 has no pipeline, its fields off.
        if not isinstance(pins.get("pp"), SearchStrategy):
            assume(pins.get("pp_schedule") in (None, "1f1b") and pins.get("pp_split") is None)
            assume(pins.get("pp_scale_grads") in (None, True))
        return case
    assume(ranks % pp == 0 and blocks >= pp)  # a pinned degree this draw cannot take
    assume(not experts_cannot_accumulate(case.model, case.precision))  # pinned on beside it: another draw
    from fsdp_verify.engines import engine_capabilities

    capabilities = engine_capabilities(case.engine)  # an engine that builds its own schedule: its scaling
    fitting = [name for name in SCHEDULES if schedule_fits(name, pp, blocks, case.microbatches)]
    assume(fitting)
    schedule = draw(pinned(pins, "pp_schedule", st.sampled_from(fitting)))
    scales = st.booleans() if capabilities.pp_scale_grads is None else st.just(capabilities.pp_scale_grads)
    scale_grads = draw(pinned(pins, "pp_scale_grads", scales))
    dp = ranks // pp
    mesh = draw(hsdp_meshes(dp)) if case.mesh_shape is not None else None
    shard = mesh[-1] if mesh else dp
    rsf = case.reshard_after_forward
    # an int the stage's smaller shard group does not divide: True below; a pinned one: not this draw
    assume("reshard_after_forward" not in pins or isinstance(rsf, bool) or shard % rsf == 0)
    model = replace(case.model, dropout=0.0)  # each stage's rank would draw its own masks
    changes: dict[str, Any] = {
        "pp": pp,
        "pp_schedule": schedule,
        "pp_scale_grads": scale_grads,
        "pp_split": draw(pinned(pins, "pp_split", st.just(case.pp_split))),  # a user's (a framework's) split
        "mesh_shape": mesh,
        "model": model,
        "sync_every_microbatch": False,
        # an int the stage's smaller shard group does not divide (not pinned: see above): True
        "reshard_after_forward": rsf if isinstance(rsf, bool) or shard % rsf == 0 else True,
        **drawn_off("pp", case),
    }
    try:
        return case.with_(**changes)
    except CaseError:
        assume(False)
        raise


def schedule_fits(schedule: str, pp: int, blocks: int, microbatches: int) -> bool:
    """Whether `schedule` over `pp` stages a rank's worth fits the model's blocks and the
    micro-batches (the Case refuses it otherwise: verify/engines/pipeline_parallel.py)."""
    from fsdp_verify.engines.pipeline_parallel import stages_per_rank

    m = microbatches
    return (
        blocks >= pp * stages_per_rank(schedule)
        and (schedule == "gpipe" or m >= pp)
        and (schedule != "interleaved1f1b" or m % max(1, m // pp) == 0)
    )
